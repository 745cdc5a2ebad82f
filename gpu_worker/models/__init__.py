"""Llama-family models (Llama, Mistral, Qwen2) and their Hugging Face checkpoint loader."""

from gpu_worker.models.config import CheckpointError, ModelConfig
from gpu_worker.models.loader import load_model

__all__ = ["CheckpointError", "ModelConfig", "load_model"]
