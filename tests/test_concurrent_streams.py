"""32 concurrent streaming clients against one `python -m server`, each text checked against the Engine in-process.

The server runs 16 sequences at a time and lets 16 more wait in the engine,
so all 32 streams are admitted and half of them start only as others finish:
the batches they decode in differ from the in-process run's. That cannot
change a greedy pick: the CPU path in float32 is deterministic and the
checkpoint is sharpened (tests/helpers/checkpoints.py multiplies the final norm by
16), so its top logits are units apart and a last-bit difference between
batch compositions cannot flip a token.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import openai
import pytest

from gpu_worker.engine.engine import Engine
from gpu_worker.engine.generate import generate
from server.generation.tokenizer import Tokenizer
from shared.config import EngineConfig
from shared.sampling_params import SamplingParams

from helpers.running_server import WAIT_S, RunningServer, start_server, stop_server

MODEL = "tiny"
NUM_STREAMS = 32
MAX_NUM_SEQS = 16
MAX_TOKENS = 16
NUM_KV_BLOCKS = 512
SERVER_FLAGS = ("--served-model-name", MODEL, "--device", "cpu", "--dtype", "float32",
                "--num-kv-blocks", str(NUM_KV_BLOCKS), "--max-num-seqs", str(MAX_NUM_SEQS),
                "--max-waiting-requests", str(NUM_STREAMS - MAX_NUM_SEQS))
PHRASES = ["Once upon a time", "The quick brown fox", "What is the capital", "Numbers: 0 1 2", "Hello there",
           "A paged attention server", "The weather today", "It said hello to"]
PROMPTS = [f"{PHRASES[i % len(PHRASES)]} {i}" for i in range(NUM_STREAMS)]  # 32 different prompts


@pytest.fixture(scope="module")
def server(tmp_path_factory, checkpoint) -> RunningServer:
    running = start_server(tmp_path_factory.mktemp("server"), checkpoint, *SERVER_FLAGS)
    yield running
    stop_server(running)


def in_process_texts(checkpoint: Path) -> list[str]:
    """PROMPTS through the Engine in this process, tokenized and detokenized as the server does it."""
    tokenizer = Tokenizer.from_dir(checkpoint)
    prompts = [tokenizer.encode(prompt) for prompt in PROMPTS]  # as /v1/completions: special tokens (bos) added
    engine = Engine(EngineConfig(model=str(checkpoint), dtype="float32", device="cpu", num_kv_blocks=NUM_KV_BLOCKS,
                                 max_num_seqs=MAX_NUM_SEQS))
    completions = generate(engine, prompts, SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True))
    assert all(c.finish_reason == "length" and len(c.token_ids) == MAX_TOKENS for c in completions)
    return [tokenizer.decode(c.token_ids, skip_special_tokens=True) for c in completions]


async def stream_completion(client: openai.AsyncOpenAI, prompt: str) -> tuple[str, str | None]:
    """One streaming completion: its pieces joined, and its finish reason."""
    stream = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                             stream=True, extra_body={"ignore_eos": True})
    pieces, finish_reason = [], None
    async for chunk in stream:
        if chunk.choices:
            pieces.append(chunk.choices[0].text)
            finish_reason = chunk.choices[0].finish_reason or finish_reason
    return "".join(pieces), finish_reason


async def stream_all(server: RunningServer) -> list[tuple[str, str | None]]:
    async with openai.AsyncOpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0,
                                  timeout=WAIT_S) as client:
        return await asyncio.gather(*(stream_completion(client, prompt) for prompt in PROMPTS))


def test_32_concurrent_greedy_streams_equal_the_engine_in_process(server, checkpoint):
    results = asyncio.run(stream_all(server))
    expected = in_process_texts(checkpoint)
    assert len(set(expected)) > 1, "the prompts must lead to different texts, or the check proves little"
    for i, ((text, finish_reason), expected_text) in enumerate(zip(results, expected)):
        assert finish_reason == "length", f"stream {i}: {finish_reason!r}"
        assert text == expected_text, f"stream {i} ({PROMPTS[i]!r}): {text!r} != {expected_text!r}"
    assert server.scrape()[f'vllm:num_requests_running{{engine="0",model_name="{MODEL}"}}'] == 0
