"""Test-wide setup that must happen before any test module imports torch or triton, and the fixtures of the
tests that run a real worker process.

Without a CUDA device, Triton kernels run in Triton's interpreter on CPU
tensors; the interpreter is chosen when triton is first imported, which
transformers and torch do early, so it is set here. Likewise the CPU tier:
under $PAGEDSERVE_CPU_ISA (PAGEDSERVE_CPU_ISA=avx2 tools/test.sh runs the
suite as an AVX2 machine would) torch and oneDNN are held to that tier
before anything imports torch, here and in every process a test starts.

The worker fixtures are module-scoped: each test module that asks for them
gets its own tiny checkpoint. Their helpers are in tests/helpers/worker_helpers.py,
imported inside the fixtures so that a test run without them never imports
torch from here.
"""

from __future__ import annotations

import os
import shutil

import pytest

from shared.config import EngineConfig
from shared.cpu_tier import limit_libraries
from shared.sampling_params import SamplingParams

if shutil.which("nvidia-smi") is None:
    os.environ.setdefault("TRITON_INTERPRET", "1")
limit_libraries(os.environ)

LONG_PROMPT = [11, 12, 13, 14, 15]
LONG_MAX_TOKENS = 70


@pytest.fixture(scope="module")
def engine_config(tmp_path_factory) -> EngineConfig:
    from helpers.worker_helpers import tiny_engine_config  # torch, only for the modules that ask

    return tiny_engine_config(tmp_path_factory.mktemp("worker"))


@pytest.fixture(scope="module")
def in_process_engine(engine_config):
    """The Engine a worker of engine_config runs, in the test process: the reference for what a worker sends."""
    from gpu_worker.engine.engine import Engine  # torch, in the test process only

    return Engine(engine_config)


@pytest.fixture(scope="module")
def long_case(in_process_engine) -> tuple[list[int], list[int]]:
    """A prompt and the in-process Engine's 70 greedy tokens for it (EOS ignored): long enough to be cut."""
    from gpu_worker.engine.generate import generate

    params = SamplingParams(max_tokens=LONG_MAX_TOKENS, temperature=0, ignore_eos=True)
    [completion] = generate(in_process_engine, [LONG_PROMPT], params)
    return LONG_PROMPT, completion.token_ids
