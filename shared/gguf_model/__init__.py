"""GGUF files (llama.cpp's format) served as they are: `pagedserve model.gguf`.

A GGUF file holds what a Hugging Face checkpoint spreads over several
files: the model's hyperparameters, its tokenizer and chat template as
metadata, and its tensors, quantized or not. unpack.py writes the metadata
out once as a checkpoint directory (config.json, tokenizer.json,
tokenizer_config.json) beside a link to the file, so that the frontend,
the worker and every tool read a GGUF model as they read any other; the
worker reads the weights from the file itself
(gpu_worker/models/gguf_weights.py).
"""
