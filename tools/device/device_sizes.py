"""The device check's sizes: on CUDA, what fits an 8-minute run on one GPU; on the CPU, a dry run of a minute or two.

CUDA: a Llama-3.2-1B-shaped checkpoint (hidden 2048, 16 layers, 32 heads, 8 KV
heads, vocab 128,256) with random bf16 weights; the mixed workload of
bench_offline scaled to 256 requests (prompts 32-512 tokens, outputs
16-256); decode steps at batch 1, 16, 64 and 256; 64 requests through HTTP and
in-process. CPU: the tiny-4l shape with a 512-token vocabulary and a handful of
short requests, and a few of each test file's tests (CI runs them all on its
own), so every part runs its real code in seconds; computed in bfloat16 where
the CPU does so natively and in float32 elsewhere, as `--dtype auto` serves a
bfloat16 checkpoint there (emulated bfloat16 would take the budget). Not a
script: device_check imports it.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True, frozen=True)
class Sizes:
    device: str  # cuda or cpu: where the tests and the benchmarks run
    dtype: str  # what the limits, offline, decode and http parts compute in
    budget_s: float  # the whole run; each part's timeout is cut to what is left of it
    install_wheels: bool  # install the wheels carried in .whl/ (CUDA), or use this environment as it is (CPU)
    pytest_flags: tuple[str, ...]  # added to each test part's pytest command
    checkpoint_name: str
    checkpoint_flags: tuple[str, ...]  # tools.bench.engine.bench_checkpoint
    offline_flags: tuple[str, ...]  # tools.bench.engine.bench_offline
    decode_flags: tuple[str, ...]  # tools.device.device_measure decode
    http_flags: tuple[str, ...]  # tools.bench.serving.bench_serving --compare-in-process


CUDA_SIZES = Sizes(
    device="cuda",
    dtype="bfloat16",
    budget_s=8 * 60,
    install_wheels=True,
    pytest_flags=(),
    checkpoint_name="llama-3.2-1b shape, bf16, random",
    checkpoint_flags=("--shape", "llama-3.2-1b", "--vocab-size", "128256", "--dtype", "bfloat16", "--device", "cuda"),
    offline_flags=("--dtype", "bfloat16", "--num-requests", "256", "--max-num-seqs", "256",
                   "--max-num-batched-tokens", "8192", "--batch-size", "64"),
    decode_flags=("--batches", "1", "16", "64", "256", "--steps", "20", "--dtype", "bfloat16"),
    http_flags=("--num-requests", "64", "--prompt-len", "32", "512", "--output-len", "16", "128",
                "--max-concurrency", "64", "--engine-args", "--dtype bfloat16 --max-num-seqs 64"),
)

def cpu_sizes(dtype: str) -> Sizes:
    """The CPU dry run's sizes, computing in `dtype`."""
    return Sizes(
        device="cpu",
        dtype=dtype,
        budget_s=240,
        install_wheels=False,
        # collected, not run: CI runs every one of them on its own, and this checks the parts' commands
        pytest_flags=("--collect-only", "-k", "matches_torch_path or llama-gqa or greedy_batch or sigkill"),
        checkpoint_name=f"tiny-4l shape, bf16, random, computed in {dtype}",
        checkpoint_flags=("--shape", "tiny-4l", "--vocab-size", "512", "--dtype", "bfloat16"),
        offline_flags=("--dtype", dtype, "--num-requests", "8", "--min-prompt", "16", "--max-prompt", "64",
                       "--min-output", "4", "--max-output", "16", "--max-num-seqs", "8", "--batch-size", "4"),
        decode_flags=("--batches", "1", "4", "16", "--steps", "5", "--dtype", dtype),
        http_flags=("--num-requests", "8", "--prompt-len", "16", "64", "--output-len", "4", "16",
                    "--max-concurrency", "4", "--engine-args", f"--dtype {dtype} --max-num-seqs 4"),
    )
