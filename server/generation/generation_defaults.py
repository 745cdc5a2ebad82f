"""GenerationDefaults: the sampling values a request gets for the fields it leaves out, as vLLM takes them.

Owns: `--generation-config` (auto: the checkpoint's generation_config.json;
vllm: none, the neutral values; a directory: its generation_config.json),
`--override-generation-config` merged over the file, and the check of both.
Must not know: request bodies, HTTP, the worker.
How: the file's temperature, top_p, top_k, min_p, repetition_penalty and
max_new_tokens are read (its other keys, such as do_sample or the token
ids, are not defaults for a request), the override's keys replace them one
by one, and a key whose merged value is null is left at the neutral value,
as in vLLM. The sampling values must make a valid SamplingParams, so a bad
file or flag stops the server at start-up. max_new_tokens is the max_tokens
of a request that gives none; a request's own values always win.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from shared.sampling_params import SamplingParams

GENERATION_CONFIG_FILE = "generation_config.json"
FROM_CHECKPOINT = "auto"
NEUTRAL = "vllm"  # vLLM's name for its own defaults: temperature 1, top_p 1, no top_k...
SAMPLING_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
MAX_TOKENS_KEY = "max_new_tokens"  # Hugging Face's name for max_tokens
KEYS = (*SAMPLING_KEYS, MAX_TOKENS_KEY)


@dataclass(frozen=True, slots=True)
class GenerationDefaults:
    """sampling: SamplingParams fields (a subset of SAMPLING_KEYS); max_tokens: None leaves each endpoint's own
    default (16 for completions, what the context leaves for chat and responses)."""

    sampling: dict = field(default_factory=dict)
    max_tokens: int | None = None

    def __post_init__(self) -> None:
        unknown = set(self.sampling) - set(SAMPLING_KEYS)
        if unknown:
            raise ValueError(f"sampling defaults must be among {', '.join(SAMPLING_KEYS)}, got {sorted(unknown)}")
        # raises the ValueError naming the field and the value
        SamplingParams(max_tokens=1 if self.max_tokens is None else self.max_tokens, **self.sampling)

    @classmethod
    def from_config(cls, config: dict) -> GenerationDefaults:
        """From a generation_config-shaped dict: KEYS with a value other than null; top_k <= 0 means no top-k."""
        values = {key: config[key] for key in KEYS if config.get(key) is not None}
        max_tokens = values.pop(MAX_TOKENS_KEY, None)
        if max_tokens is not None and (not isinstance(max_tokens, int) or isinstance(max_tokens, bool)
                                       or max_tokens < 1):
            raise ValueError(f"{MAX_TOKENS_KEY} must be an integer >= 1, got {max_tokens!r}")
        if isinstance(values.get("top_k"), int) and values["top_k"] <= 0:  # Hugging Face's and vLLM's "off"
            del values["top_k"]
        return cls(values, max_tokens)

    def describe(self) -> str:
        """For the log: `temperature=0.8, top_p=0.95`, or `none`."""
        values = {**self.sampling, **({"max_tokens": self.max_tokens} if self.max_tokens is not None else {})}
        return ", ".join(f"{key}={value}" for key, value in values.items()) or "none"


def parse_override(text: str) -> dict:
    """--override-generation-config's JSON object (check_override checks its keys and values)."""
    try:
        override = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"--override-generation-config must be a JSON object, got invalid JSON {text!r}: {exc}") from None
    if not isinstance(override, dict):
        raise ValueError(f"--override-generation-config must be a JSON object, got {text!r}")
    return override


def check_override(override: dict) -> None:
    """ValueError naming --override-generation-config for a key outside KEYS or a bad value."""
    unknown = sorted(set(override) - set(KEYS))
    if unknown:
        raise ValueError(f"--override-generation-config takes {', '.join(KEYS)}, got {', '.join(map(repr, unknown))}")
    try:
        GenerationDefaults.from_config(override)
    except ValueError as exc:
        raise ValueError(f"--override-generation-config: {exc}") from None


def generation_config_path(generation_config: str, model_dir: str) -> Path | None:
    """The file `--generation-config` names: the checkpoint's (auto), none (vllm), or the directory's."""
    if generation_config == NEUTRAL:
        return None
    if generation_config == FROM_CHECKPOINT:
        return Path(model_dir) / GENERATION_CONFIG_FILE
    path = Path(generation_config) / GENERATION_CONFIG_FILE
    if not path.is_file():
        raise ValueError(f"--generation-config: expected {FROM_CHECKPOINT}, {NEUTRAL} or a directory holding "
                         f"{GENERATION_CONFIG_FILE}, got {generation_config!r} (no {path})")
    return path


def read_generation_config(path: Path | None) -> dict:
    """The file's JSON object; {} for no file (vllm, or a checkpoint without one)."""
    if path is None or not path.is_file():
        return {}
    config = json.loads(path.read_text())
    if not isinstance(config, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(config).__name__}")
    return config


def load_generation_defaults(path: Path | None, override: dict) -> GenerationDefaults:
    """The file's defaults with the override's keys replacing them; ValueError naming the file for a bad value."""
    try:
        file_defaults = read_generation_config(path)
        GenerationDefaults.from_config(file_defaults)
    except ValueError as exc:
        raise ValueError(f"{path}: {exc}") from None
    return GenerationDefaults.from_config({**file_defaults, **override})
