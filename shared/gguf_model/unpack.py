"""A GGUF file as a checkpoint directory: what `pagedserve model.gguf` serves.

Owns writing the directory once per file: config.json (metadata.py),
tokenizer.json and tokenizer_config.json (tokenizer.py), and GGUF_FILE, a
link to the file, from which the worker reads the weights. The directory
lies under $XDG_CACHE_HOME/pagedserve/gguf (~/.cache/pagedserve/gguf), one
per file path, size and modification time, so an edited file gets a new
one; it is written whole into a temporary directory and renamed into place,
so a start never sees half of one.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

from shared.gguf_model.metadata import GGUF_FILE, GgufError, fields, model_config, open_reader
from shared.gguf_model.tokenizer import tokenizer_config, tokenizer_json
from shared.vocabulary import TOKENIZER_FILE


def cache_root() -> Path:
    """Where unpacked GGUF directories live: $XDG_CACHE_HOME/pagedserve/gguf, else ~/.cache/pagedserve/gguf."""
    base = os.environ.get("XDG_CACHE_HOME") or Path("~/.cache").expanduser()
    return Path(base) / "pagedserve" / "gguf"


def unpacked_dir(gguf_path: str | Path, root: Path | None = None) -> Path:
    """The checkpoint directory for the GGUF file at `gguf_path`, written on first use; GgufError naming what
    the file holds that is not served, or why the directory cannot be written."""
    path = Path(gguf_path).expanduser().resolve()
    stat = path.stat()
    digest = hashlib.sha256(f"{path}\0{stat.st_size}\0{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    root = root or cache_root()
    target = root / f"{path.stem}-{digest}"
    if (target / "config.json").is_file():
        return target
    reader = open_reader(path)
    meta = fields(reader)
    config = model_config(meta, {tensor.name: tensor.tensor_type for tensor in reader.tensors}, path)
    files = {"config.json": config, TOKENIZER_FILE: tokenizer_json(meta, path),
             "tokenizer_config.json": tokenizer_config(meta)}
    try:
        root.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=root))
        for name, contents in files.items():
            (staging / name).write_text(json.dumps(contents, ensure_ascii=False), encoding="utf-8")
        (staging / GGUF_FILE).symlink_to(path)
        try:
            staging.rename(target)
        except OSError:  # another start unpacked the same file first
            shutil.rmtree(staging, ignore_errors=True)
    except OSError as error:
        raise GgufError(f"{path}: cannot write its unpacked metadata under {root} ({error}); set XDG_CACHE_HOME "
                        f"to a writable directory") from None
    return target
