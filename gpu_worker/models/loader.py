"""load_model: a Hugging Face checkpoint directory -> a ready model on a device.

Owns finding and reading the safetensors files (one model.safetensors, or
shards listed by model.safetensors.index.json), choosing the dtype, and
checking that every tensor the model needs is present with the right shape.
Every problem raises CheckpointError naming the file; nothing is loaded
half-way silently. Tensors the model does not use (e.g. lm_head.weight of a
tied checkpoint) are ignored.
"""

from __future__ import annotations

import json
import logging
from collections import defaultdict
from collections.abc import Collection, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from gpu_worker.models import prequantized
from gpu_worker.models.config import CHECKPOINT_DTYPES, CheckpointError, ModelConfig, read_model_config
from gpu_worker.models.dtype_policy import AUTO, compute_dtype
from gpu_worker.models.gguf_weights import BLOCK, load_gguf_weights
from gpu_worker.models.llama import AttentionFn, LlamaForCausalLM
from gpu_worker.models.packed_linear import pack_linears
from gpu_worker.models.quantization import QuantizedWeight
from gpu_worker.models.quantized_linear import LM_HEAD_SCHEME, quantize_linears, replace_linears
from shared.cpu_tier import CpuTier, current_tier
from shared.gguf_model.metadata import GGUF_FILE

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
_MAX_NAMES_IN_ERROR = 5

logger = logging.getLogger("pagedserve.worker")


def load_model(path: str | Path, dtype: str | torch.dtype = "auto", device: str | torch.device = "cpu", *,
               attention: AttentionFn, tier: CpuTier | None = None,
               quantization: str | None = None) -> tuple[LlamaForCausalLM, ModelConfig]:
    """Build the model described by path/config.json and fill it from path's safetensors.

    dtype "auto" takes the checkpoint's (float32 when config.json names
    none), on the CPU as far as it computes it natively (dtype_policy.py);
    otherwise float32, float16 or bfloat16, as a torch.dtype or its name.
    `attention` is the paged attention function every layer calls.
    A GGUF file unpacked as a directory (shared/gguf_model) is read from
    the file (gguf_weights.py). A checkpoint quantized already
    (compressed-tensors W8A16 or W4A16, or GPTQ, named by config.json's
    quantization_config) has its decoder's
    linear layers read as quantized ones (prequantized.py); a float
    one gets them from `quantization` (int8, int4) at load
    (quantized_linear.py). On the CPU the other linear layers'
    weights are then packed the CPU tier's fastest way (this process's tier
    by default; packed_linear.py).
    """
    model_dir = Path(path)
    if not model_dir.is_dir():
        raise CheckpointError(f"{model_dir}: checkpoint directory not found")
    config = read_model_config(model_dir)
    tier = tier or current_tier()
    device = torch.device(device)
    choice = compute_dtype(_requested_dtype(dtype), config.torch_dtype, device, tier)
    logger.log(logging.WARNING if choice.emulated else logging.INFO, "computing in %s: %s",
               str(choice.dtype).removeprefix("torch."), choice.why)
    if (model_dir / GGUF_FILE).exists():
        model = LlamaForCausalLM(config, attention, choice.dtype, device)
        _load_gguf(model, config, model_dir / GGUF_FILE, tier, quantization)
        pack_linears(model, tier)
        return model.eval(), config
    scheme = prequantized.read_scheme(json.loads((model_dir / "config.json").read_text()), model_dir / "config.json")
    if scheme is not None and quantization is not None:
        raise CheckpointError(f"{model_dir}: the checkpoint is quantized already ({scheme.describe()}); "
                              f"--quantization {quantization} quantizes float checkpoints, leave it out")
    model = LlamaForCausalLM(config, attention, choice.dtype, device)
    parts = {} if scheme is None else prequantized.quantized_parts(model, model.checkpoint_tensors(), scheme.ignore)
    load_weights(model, model_dir, skip={f"{name}.weight" for names in parts.values() for name in names})
    model.requires_grad_(False)
    if scheme is not None:
        count = replace_linears(model, _read_prequantized(model_dir, parts, scheme), tier)
        logger.info("read %d linear layers as %s (the others keep %s)", count, scheme.describe(),
                    str(choice.dtype).removeprefix("torch."))
    elif quantization is not None:
        count = quantize_linears(model, quantization, tier)
        logger.info("quantized %d linear layers at load, weight-only: the decoder's to %s, the lm_head to %s "
                    "(activations and embeddings keep %s)", count, quantization, LM_HEAD_SCHEME,
                    str(choice.dtype).removeprefix("torch."))
    pack_linears(model, tier)
    return model.eval(), config


def _load_gguf(model: LlamaForCausalLM, config: ModelConfig, file: Path, tier: CpuTier,
               quantization: str | None) -> None:
    """Fill `model` from a GGUF file (gguf_weights.py): Q8_0 and Q4_0 linear layers stay quantized; a file with
    none may be quantized at load."""
    quantized = load_gguf_weights(model, config, file.resolve())
    model.requires_grad_(False)
    if quantized and quantization is not None:
        raise CheckpointError(f"{file.resolve()}: the GGUF file is quantized already; --quantization {quantization} "
                              f"quantizes float checkpoints, leave it out")
    if quantized:
        schemes = sorted({weight.scheme for weight in quantized.values()})
        count = replace_linears(model, quantized, tier)
        logger.info("read %d linear layers from GGUF blocks of %d as %s", count, BLOCK, " and ".join(schemes))
    elif quantization is not None:
        quantize_linears(model, quantization, tier)


def _requested_dtype(dtype: str | torch.dtype) -> str | torch.dtype:
    if dtype == AUTO:
        return AUTO
    resolved = CHECKPOINT_DTYPES.get(dtype) if isinstance(dtype, str) else dtype
    if resolved is None or resolved not in CHECKPOINT_DTYPES.values():
        raise ValueError(f"dtype must be 'auto' or one of {', '.join(CHECKPOINT_DTYPES)}, got {dtype!r}")
    return resolved


def load_weights(model: LlamaForCausalLM, model_dir: Path, skip: Collection[str] = ()) -> None:
    """Copy every tensor model.checkpoint_tensors() names but those in `skip` from model_dir's safetensors,
    casting dtype."""
    targets = {name: tensor for name, tensor in model.checkpoint_tensors().items() if name not in skip}
    locations, listing = _tensor_locations(model_dir)
    missing = [name for name in targets if name not in locations]
    if missing:
        shown = ", ".join(missing[:_MAX_NAMES_IN_ERROR])
        raise CheckpointError(f"{listing}: missing {len(missing)} tensor(s) the model needs: {shown}")
    names_by_file: dict[Path, list[str]] = defaultdict(list)
    for name in targets:
        names_by_file[locations[name]].append(name)
    with torch.no_grad():
        for file, names in names_by_file.items():
            with _open(file) as tensors:
                for name in names:
                    _copy_tensor(tensors, file, name, targets[name])


def _read_prequantized(model_dir: Path, parts: dict[str, list[str]],
                       scheme: prequantized.PrequantizedScheme) -> dict[str, QuantizedWeight]:
    """Module name -> its weight read from a quantized checkpoint (`parts`: the checkpoint layers that fill it)."""
    locations, listing = _tensor_locations(model_dir)
    tensors = _LazyTensors(locations, listing, scheme.describe())
    return {module: prequantized.merge([scheme.read_layer(tensors, name, listing) for name in names])
            for module, names in parts.items()}


class _LazyTensors(Mapping[str, torch.Tensor]):
    """A checkpoint's tensors by name, each read from its file when looked up; a missing one is a CheckpointError."""

    def __init__(self, locations: dict[str, Path], listing: Path, what: str) -> None:
        self.locations, self.listing, self.what = locations, listing, what
        self.opened: dict[Path, Any] = {}  # safetensors' open files

    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in self.locations:
            raise CheckpointError(f"{self.listing}: missing tensor {name!r} of a {self.what} checkpoint")
        file = self.locations[name]
        if file not in self.opened:
            self.opened[file] = _open(file)
        try:
            return self.opened[file].get_tensor(name)
        except SafetensorError as error:
            raise CheckpointError(f"{file}: tensor {name!r} cannot be read ({error})") from None

    def __contains__(self, name: object) -> bool:
        return name in self.locations

    def __iter__(self) -> Iterator[str]:
        return iter(self.locations)

    def __len__(self) -> int:
        return len(self.locations)


def _tensor_locations(model_dir: Path) -> tuple[dict[str, Path], Path]:
    """(tensor name -> the file holding it, the file that lists them: index or single file)."""
    index = model_dir / INDEX_FILE
    if index.is_file():
        return _index_locations(index), index
    single = model_dir / SINGLE_FILE
    if single.is_file():
        with _open(single) as tensors:
            return {name: single for name in tensors.keys()}, single
    raise CheckpointError(f"{model_dir}: no {SINGLE_FILE} or {INDEX_FILE} (only safetensors checkpoints load)")


def _index_locations(index: Path) -> dict[str, Path]:
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError) as error:
        raise CheckpointError(f"{index}: not a safetensors index with a weight_map ({error!r})") from None
    locations = {name: index.parent / shard for name, shard in weight_map.items()}
    for shard in sorted(set(locations.values())):
        if not shard.is_file():
            raise CheckpointError(f"{index}: names shard {shard.name!r}, which is missing")
    return locations


def _open(file: Path):
    try:
        return safe_open(str(file), framework="pt", device="cpu")
    except (SafetensorError, OSError) as error:
        raise CheckpointError(f"{file}: not a readable safetensors file ({error})") from None


def _copy_tensor(tensors, file: Path, name: str, target: torch.Tensor) -> None:
    if name not in tensors.keys():
        raise CheckpointError(f"{file}: missing tensor {name!r}")
    shape = tuple(tensors.get_slice(name).get_shape())
    if shape != tuple(target.shape):
        raise CheckpointError(f"{file}: tensor {name!r} has shape {list(shape)}, expected {list(target.shape)}")
    try:
        tensor = tensors.get_tensor(name)
    except SafetensorError as error:
        raise CheckpointError(f"{file}: tensor {name!r} cannot be read ({error})") from None
    if not tensor.is_floating_point():
        raise CheckpointError(f"{file}: tensor {name!r} has dtype {tensor.dtype}, expected a floating-point dtype")
    target.copy_(tensor)
