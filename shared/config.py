"""EngineConfig: what the worker is started with (model, cache and batching limits).

The frontend builds it from the command line and hands it to the worker; the
in-process Engine takes it directly. Validated on construction with errors
naming the field and the value.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from typing import Any

DTYPES = ("auto", "float32", "bfloat16", "float16")
DTYPE_ALIASES = {"float": "float32", "half": "float16", "fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
RESOLVED_DEVICES = ("cpu", "cuda")  # what a worker runs on; "auto" is decided once (EngineConfig's docstring)
DEVICES = ("auto", *RESOLVED_DEVICES)
DEFAULT_CPU_KV_CACHE_MEMORY = 1 << 30  # the KV cache budget on the CPU when kv_cache_memory is None
QUANTIZATION_SCHEMES = ("int8", "int4")  # weight-only, at load: gpu_worker/models/quantization.py
INT4_GROUP_SIZE = 32  # int4's inputs a scale covers (quantization.py says why 32)
TARGET_ITL_AUTO_FACTOR = 2.5  # target_itl_ms None: this many times the running streams' own step time
_SIZE_UNITS = {"": 1, "B": 1, "K": 1000, "KB": 1000, "M": 1000**2, "MB": 1000**2, "G": 1000**3, "GB": 1000**3,
               "KIB": 1024, "MIB": 1024**2, "GIB": 1024**3, "TIB": 1024**4, "T": 1000**4, "TB": 1000**4}


def parse_memory_size(text: str | int) -> int:
    """'2GiB', '512MiB', '1.5GB' or a plain byte count -> bytes."""
    if isinstance(text, int):
        return text
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", text)
    unit = match.group(2).upper() if match else None
    if match is None or unit not in _SIZE_UNITS:
        raise ValueError(f"memory size must look like 2GiB, 512MiB or 1000000, got {text!r}")
    return int(float(match.group(1)) * _SIZE_UNITS[unit])


def format_memory_size(num_bytes: int) -> str:
    """bytes -> '1GiB', '512MiB', '4KiB' (the largest binary unit that divides it), else a plain byte count: what
    parse_memory_size reads back."""
    for unit in ("TiB", "GiB", "MiB", "KiB"):
        size = _SIZE_UNITS[unit.upper()]
        if num_bytes and num_bytes % size == 0:
            return f"{num_bytes // size}{unit}"
    return str(num_bytes)


def field_defaults(cls: type) -> dict[str, Any]:
    """The default of each field of the dataclass `cls` that has a plain one, by name: what a command line's
    flags read their defaults from, so that a default is written once, in the dataclass (a slots dataclass keeps
    none as a class attribute to read)."""
    return {f.name: f.default for f in dataclasses.fields(cls) if f.default is not dataclasses.MISSING}


def _check(condition: bool, name: str, value: object, expected: str) -> None:
    if not condition:
        raise ValueError(f"{name} must be {expected}, got {value!r}")


@dataclass(slots=True)
class EngineConfig:
    """Model, KV cache and batching settings of one engine.

    The KV pool is sized from `kv_cache_memory` bytes; when that is not
    given, on CUDA from `gpu_memory_utilization` of the memory left after the
    weights, on the CPU DEFAULT_CPU_KV_CACHE_MEMORY. `num_kv_blocks` overrides
    all of them (tests use it to force preemption). `device` auto is cuda when
    torch sees a GPU, else cpu, as the worker's select_device decides
    (gpu_worker/runner/model_runner.py); the server resolves it once before it
    starts a worker (server/worker/sharing.py resolve_device), an in-process
    Engine when it loads. `max_model_len` None takes the model's context length.
    `enable_prefix_caching` lets requests share the KV blocks of a common
    prompt prefix instead of computing it again. `cpu_threads` is the
    worker's torch/OpenMP thread count on the CPU; None takes the CPUs the
    process may use (gpu_worker/native/cpu_threads.py) or, from 4 of them, the
    count among them, their half and their quarter that the model's steps run
    fastest on (gpu_worker/engine/thread_choice.py). `cpu_threads_asked`
    says whether that count was asked for (--cpu-threads) rather than carried
    over by the frontend from a worker that chose it: None takes
    `cpu_threads is not None`. A count not asked for is lowered while other
    busy processes share the CPUs (gpu_worker/engine/cpu_contention.py).
    `target_itl_ms` bounds
    the time of a step that holds decodes, so that prefill chunks never stall
    running streams for long (gpu_worker/scheduling/latency_target.py): None
    derives the bound from the decodes' own step time (TARGET_ITL_AUTO_FACTOR
    times it), 0 lets every step fill the token budget. `tokenizer` is the
    directory the tokenizer is read from, when it is not the checkpoint's own
    (`tokenizer_dir` is the one in use). Each field's default here is the one
    its command-line flag takes (shared/engine_args.py reads it).
    """

    model: str
    tokenizer: str | None = None
    dtype: str = "auto"
    device: str = "auto"
    block_size: int = 16
    kv_cache_memory: int | None = None
    gpu_memory_utilization: float = 0.9
    num_kv_blocks: int | None = None
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 256
    max_model_len: int | None = None
    enable_prefix_caching: bool = True
    seed: int = 0
    cpu_threads: int | None = None
    cpu_threads_asked: bool | None = None
    target_itl_ms: float | None = None
    quantization: str | None = None

    def __post_init__(self) -> None:
        self.dtype = DTYPE_ALIASES.get(self.dtype, self.dtype)
        _check(self.dtype in DTYPES, "dtype", self.dtype, f"one of {', '.join(DTYPES)}")
        _check(self.device in DEVICES, "device", self.device, f"one of {', '.join(DEVICES)}")
        _check(self.block_size in (1, 2, 4, 8, 16, 32, 64, 128), "block_size", self.block_size,
               "a power of two between 1 and 128")
        if self.kv_cache_memory is not None:
            self.kv_cache_memory = parse_memory_size(self.kv_cache_memory)
            _check(self.kv_cache_memory > 0, "kv_cache_memory", self.kv_cache_memory, "> 0 bytes")
        _check(0 < self.gpu_memory_utilization <= 1, "gpu_memory_utilization", self.gpu_memory_utilization,
               "a fraction in (0, 1]")
        _check(self.num_kv_blocks is None or self.num_kv_blocks >= 1, "num_kv_blocks", self.num_kv_blocks,
               "None or >= 1")
        _check(self.max_num_batched_tokens >= 1, "max_num_batched_tokens", self.max_num_batched_tokens, ">= 1")
        _check(self.max_num_seqs >= 1, "max_num_seqs", self.max_num_seqs, ">= 1")
        _check(self.target_itl_ms is None or (isinstance(self.target_itl_ms, (int, float))
                                               and 0 <= self.target_itl_ms < float("inf")),
               "target_itl_ms", self.target_itl_ms, "None or a number of milliseconds >= 0")
        _check(self.quantization is None or self.quantization in QUANTIZATION_SCHEMES, "quantization",
               self.quantization, f"None or one of {', '.join(QUANTIZATION_SCHEMES)}")
        _check(self.cpu_threads is None or self.cpu_threads >= 1, "cpu_threads", self.cpu_threads, "None or >= 1")
        if self.cpu_threads_asked is None:
            self.cpu_threads_asked = self.cpu_threads is not None
        _check(self.max_model_len is None or self.max_model_len >= 2, "max_model_len", self.max_model_len,
               "None or >= 2")

    @property
    def tokenizer_dir(self) -> str:
        """Where the tokenizer's files are read from: --tokenizer, else the checkpoint."""
        return self.tokenizer or self.model
