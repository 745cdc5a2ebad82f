"""The default model's trainer (train_default_model, the script) and its parts: corpus, tokenizer, model, training
loop, export, model card."""
