"""DEFAULT_MODEL_DIR: the checkpoint served when no --model is given.

A small Llama trained on Shakespeare by tools/training/train_default_model.py and
shipped in shared/default_model/ (Hugging Face layout; see its MODEL.md).
Only a path: importing this loads nothing, so the frontend may use it
without torch.
"""

from __future__ import annotations

from pathlib import Path

DEFAULT_MODEL_DIR = Path(__file__).resolve().parent / "default_model"
DEFAULT_MODEL_NAME = "pagedserve-shakespeare"  # what /v1/models calls it when no --model is given
