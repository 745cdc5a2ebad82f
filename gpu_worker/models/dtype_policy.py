"""The dtype a model computes in: the checkpoint's or the one asked for, held on the CPU to what it runs natively.

Owns that choice and the sentence that explains it in the worker's log;
knows nothing of loading. On a GPU, "auto" is the checkpoint's dtype and an
explicit dtype is obeyed. On the CPU, bfloat16 pays only where the hardware
computes it (AVX-512 BF16, AMX, ARM's bf16): elsewhere every bfloat16
matmul widens to float32 first and runs slower than float32 itself, and
oneDNN refuses to pack it. So "auto" with a bfloat16 or float16 checkpoint
computes in bfloat16 where that is native and in float32 elsewhere; an
explicit --dtype bfloat16 is obeyed everywhere, with a warning where it is
emulated. The KV cache follows the model's dtype.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from shared.cpu_tier import CpuTier

AUTO = "auto"


class DtypeChoice(NamedTuple):
    dtype: torch.dtype
    why: str  # one clause for the worker's log
    emulated: bool  # asked for a dtype this CPU does not compute natively: it serves, slower (a warning)


def compute_dtype(requested: str | torch.dtype, checkpoint_dtype: torch.dtype, device: torch.device,
                  tier: CpuTier) -> DtypeChoice:
    """The dtype to compute in and why; `requested` is "auto" or a torch.dtype."""
    if requested != AUTO:
        assert isinstance(requested, torch.dtype)
        if device.type == "cpu" and requested == torch.bfloat16 and not tier.has_native_bf16:
            return DtypeChoice(requested, f"bfloat16 as asked, emulated on this CPU ({tier.name} has no native "
                                          "bfloat16): slower than float32, which --dtype auto would choose", True)
        return DtypeChoice(requested, "as asked (--dtype)", False)
    name = str(checkpoint_dtype).removeprefix("torch.")
    if device.type != "cpu" or checkpoint_dtype == torch.float32:
        return DtypeChoice(checkpoint_dtype, f"the checkpoint's {name}", False)
    if tier.has_native_bf16:
        return DtypeChoice(torch.bfloat16, f"bfloat16 for the checkpoint's {name}: native on this CPU ({tier.name})",
                           False)
    return DtypeChoice(torch.float32, f"float32 for the checkpoint's {name}: this CPU ({tier.name}) has no native "
                                      "bfloat16, so float32 is faster (twice the weight memory; --dtype bfloat16 "
                                      "forces it)", False)
