"""The default model served with no flags as each lower CPU tier would serve it, through $PAGEDSERVE_CPU_ISA.

The embedded model's checkpoint is bfloat16. On a CPU without native
bfloat16 (an AVX2 EPYC, an older Xeon: the avx2 and x86-64 tiers, and
avx512 without its BF16 extension) the worker computes in float32, says so
in its log and its ready line, packs nothing oneDNN cannot take, and loads
that tier's kernel builds where they beat torch's ops there (not attention,
whose kernels need 512-bit vectors); torch and oneDNN are held to the tier
too, so this runs here exactly what such a machine runs.
"""

from __future__ import annotations

import pytest

from gpu_worker.attention import PREFILL_KERNEL_MIN_VECTOR_BITS
from shared.cpu_tier import OVERRIDE_VARIABLE
from shared.default_model import DEFAULT_MODEL_NAME

from helpers.cpu_tiers import KERNEL_TIERS
from helpers.running_server import start_server, stop_server

LOWER_TIERS = [pytest.param(tier, id=tier.name) for tier in KERNEL_TIERS if tier.name in ("x86-64", "avx2")]


@pytest.mark.parametrize("tier", LOWER_TIERS)
def test_the_default_model_serves_in_float32_on_a_tier_without_native_bfloat16(tmp_path, tier):
    server = start_server(tmp_path, None, env={OVERRIDE_VARIABLE: tier.name}, timeout=180)
    try:
        stream = server.client().completions.create(model=DEFAULT_MODEL_NAME, prompt="ROMEO:", max_tokens=12,
                                                    temperature=0, stream=True)
        text = "".join(chunk.choices[0].text for chunk in stream if chunk.choices)
        log = server.log.read_text()
    finally:
        stop_server(server)
    assert text.strip(), log
    assert f"CPU tier {tier.name} (no native bfloat16; kernels built for {tier.name}), as ${OVERRIDE_VARIABLE}=" in log
    assert "computing in float32: float32 for the checkpoint's bfloat16" in log
    assert f"(float32, CPU tier {tier.name})" in log, "the ready line names the dtype and the tier"
    assert f"cpu_fused.c: the {tier.name} build, installed" in log
    assert f"cpu_decode.c: the {tier.name} build, installed" in log  # every tier's vectors fit its registers
    if tier.vector_bits >= PREFILL_KERNEL_MIN_VECTOR_BITS:
        assert f"cpu_prefill.c: the {tier.name} build, installed" in log
        assert f"cpu_linear.c: the {tier.name} build, installed" in log, "float32 linears on the tiled kernel"
    else:
        assert f"attention: prefill on the torch path, faster on this CPU tier ({tier.name}" in log
    assert "Traceback" not in log and "unavailable" not in log
