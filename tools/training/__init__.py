"""The default-model trainer's parts: corpus, tokenizer, model, training loop, export."""
