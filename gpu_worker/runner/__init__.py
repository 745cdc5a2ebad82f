"""The model runner: one scheduled step in, one packed forward pass, logits out."""
