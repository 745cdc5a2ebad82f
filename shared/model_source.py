"""Where a `--model` or `--tokenizer` value lies on disk: a directory as given, a GGUF file, or a Hugging Face id
from the cache.

A value that names an existing directory is that directory; a GGUF file is
served from the directory its metadata is unpacked into (gguf_model/). Anything else
that could be a Hugging Face repository id (`org/name`, or `name`) is looked
up in the local Hugging Face cache, laid out as huggingface_hub writes it:

    <cache>/models--org--name/refs/<revision>          the commit the revision points at
    <cache>/models--org--name/snapshots/<commit>/...   that commit's files

The revision is a branch or tag (a file under refs/) or a commit hash (a
snapshot directory of that name). The cache is `--download-dir` when given,
else $HF_HUB_CACHE, else $HF_HOME/hub, else ~/.cache/huggingface/hub: the
order huggingface_hub itself follows. This server downloads nothing: a
snapshot that is not in the cache is a ValueError naming the path searched.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from shared.gguf_model.metadata import is_gguf_file
from shared.gguf_model.unpack import unpacked_dir

DEFAULT_REVISION = "main"
# huggingface_hub's repository ids: an optional namespace and a name of letters, digits, '-', '_' and '.'.
HF_REPO_ID = re.compile(r"(?:[A-Za-z0-9][\w.-]*/)?[A-Za-z0-9][\w.-]*")


def hf_cache_dir(download_dir: str | None = None) -> Path:
    """The Hugging Face hub cache this process would read: --download-dir, $HF_HUB_CACHE, $HF_HOME/hub, the default."""
    if download_dir:
        return Path(download_dir).expanduser()
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    hf_home = os.environ.get("HF_HOME") or Path(os.environ.get("XDG_CACHE_HOME") or "~/.cache") / "huggingface"
    return Path(hf_home).expanduser() / "hub"


def resolve_model_dir(model: str, revision: str | None = None, download_dir: str | None = None) -> str:
    """The directory `model` names: itself when it is one, a GGUF file's unpacked directory (gguf_model/unpack.py),
    else its cached snapshot at `revision` (default main).

    A value that is neither an existing directory nor a repository id is returned as given, so that the
    loader's own error names it."""
    if is_gguf_file(model):
        return str(unpacked_dir(model))
    if Path(model).expanduser().is_dir() or not HF_REPO_ID.fullmatch(model):
        return model
    cache = hf_cache_dir(download_dir)
    repo_dir = cache / ("models--" + model.replace("/", "--"))
    revision = revision or DEFAULT_REVISION
    snapshot = _snapshot_dir(repo_dir, revision)
    if snapshot is None:
        raise ValueError(f"expected the Hugging Face model {model!r} (revision {revision!r}) in the local cache, "
                         f"found no snapshot under {repo_dir}; this server downloads nothing: fetch it first "
                         f"(e.g. `huggingface-cli download {model} --revision {revision}`, with --cache-dir {cache} "
                         f"if that is not your default), or pass --download-dir with the cache that holds it")
    return str(snapshot)


def _snapshot_dir(repo_dir: Path, revision: str) -> Path | None:
    """snapshots/<commit> for a revision that refs/ names, or a revision that is itself a snapshot's commit."""
    ref = repo_dir / "refs" / revision
    commit = ref.read_text(encoding="utf-8").strip() if ref.is_file() else revision
    snapshot = repo_dir / "snapshots" / commit
    return snapshot if snapshot.is_dir() else None
