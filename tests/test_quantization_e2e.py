"""--quantization against `python -m server` on the embedded default model in float32, read through the openai SDK.

What must hold: a server started with --quantization int8 (or -q int4)
quantizes the decoder's linear layers at load, says so in its worker's log,
and streams the very greedy tokens the in-process Engine produces with the
same EngineConfig quantization for the same prompt ids (from the server's
/tokenize); a greedy int8 stream whose worker is SIGKILLed mid-decode
resumes on a restarted worker, quantized again, and ends with the tokens of
a fault-free run, whether the new worker adopts the stream's KV from the
shared segment or recomputes it in one prefill; and a scheme it does not know (fp8) stops the server
before it starts, with argparse naming the accepted int8 and int4.
"""

from __future__ import annotations

import functools
import json
import os
import re
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpu_worker.engine.engine import Engine
from gpu_worker.engine.generate import generate
from server.generation.tokenizer import Tokenizer
from shared.config import EngineConfig
from shared.default_model import DEFAULT_MODEL_DIR, DEFAULT_MODEL_NAME
from shared.sampling_params import SamplingParams

from helpers.completion_streams import Stream, run_streams
from helpers.metrics_scrape import rise
from helpers.running_server import WAIT_S, RunningServer, start_server, stop_server

# Prompts whose greedy float32 text the scheme changes within MAX_TOKENS, so that matching the quantized Engine
# proves the server computed with quantized weights.
PROMPTS = {"int8": "Is there no exorcist", "int4": "KING HENRY:"}
MAX_TOKENS = 24
LONG_MAX_TOKENS = 480  # about a second of decode on 2 cores; the prompt and these fit max_model_len 512
KILL_AFTER_TOKENS = 32
# --target-itl-ms 0: every prompt prefilled whole, as the Engine below does it.
FLAGS = ("--device", "cpu", "--dtype", "float32", "--standby-workers", "0", "--target-itl-ms", "0")
RECOVERY_FIGURES = re.compile(r"(\d+)\D*adopted\D*(\d+)\D*recomputed")
QUANTIZED = re.compile(r"worker\[\d+\] epoch (\d+) INFO quantized (\d+) linear layers at load, weight-only: the "
                       r"decoder's to (\w+), the lm_head to int8 \(activations and embeddings keep float32\)")
LINEARS_PER_LAYER = 4  # qkv, o, gate_up, down
EXIT_TIMEOUT_S = 60
# argparse's message, whether or not this Python's argparse quotes the choices.
INVALID_CHOICE = re.compile(r"argument --quantization/-q: invalid choice: '?fp8'? \(choose from '?int8'?, '?int4'?\)")


def num_quantized_linears() -> int:
    """The decoder's linear layers and the lm_head."""
    config = json.loads((DEFAULT_MODEL_DIR / "config.json").read_text())
    return LINEARS_PER_LAYER * config["num_hidden_layers"] + 1


def quantized_lines(server: RunningServer) -> list[tuple[int, int, str]]:
    """(epoch, layers, scheme) of each worker's "quantized ... at load" line, in order."""
    return [(int(epoch), int(count), scheme) for epoch, count, scheme in QUANTIZED.findall(server.log.read_text())]


def recovery_figures(server: RunningServer) -> list[tuple[int, int]]:
    """(adopted, recomputed) KV positions of each recovery the log has a line for, in order."""
    matches = map(RECOVERY_FIGURES.search, server.log.read_text().splitlines())
    return [(int(match[1]), int(match[2])) for match in matches if match]


def start_quantized(tmp: Path, *flags: str) -> Iterator[RunningServer]:
    server = start_server(tmp, None, *flags, *FLAGS)
    try:
        yield server
    finally:
        stop_server(server)


@pytest.fixture(scope="module")
def int8_server(tmp_path_factory) -> Iterator[RunningServer]:
    """The KV cache in a shared segment (the default): a restarted worker adopts what the killed one wrote."""
    yield from start_quantized(tmp_path_factory.mktemp("int8"), "--quantization", "int8")


@pytest.fixture(scope="module")
def int8_private_kv_server(tmp_path_factory) -> Iterator[RunningServer]:
    """A private KV cache: a restarted worker recomputes the stream's KV in one prefill, through the quantized
    layers with many rows where the killed worker decoded them one row at a time."""
    yield from start_quantized(tmp_path_factory.mktemp("int8-private"), "-q", "int8", "--no-shared-kv-cache")


@pytest.fixture(scope="module")
def int4_server(tmp_path_factory) -> Iterator[RunningServer]:
    yield from start_quantized(tmp_path_factory.mktemp("int4"), "-q", "int4")


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.from_dir(DEFAULT_MODEL_DIR)


def prompt_ids(server: RunningServer, prompt: str) -> tuple[int, ...]:
    return tuple(server.post_ok("/tokenize", {"prompt": prompt})["tokens"])


@functools.cache
def in_process_tokens(scheme: str | None, prompt: tuple[int, ...], max_tokens: int) -> tuple[int, ...]:
    """The Engine's greedy tokens (EOS ignored) for `prompt`, quantized under `scheme` (None: not at all)."""
    engine = Engine(EngineConfig(model=str(DEFAULT_MODEL_DIR), dtype="float32", device="cpu", quantization=scheme,
                                 num_kv_blocks=64, target_itl_ms=0))
    [completion] = generate(engine, [list(prompt)], SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))
    assert (completion.finish_reason, len(completion.token_ids)) == ("length", max_tokens), completion
    return tuple(completion.token_ids)


def greedy(prompt: str, max_tokens: int) -> dict:
    return {"model": DEFAULT_MODEL_NAME, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "logprobs": 0,
            "extra_body": {"ignore_eos": True}}


def stream(server: RunningServer, prompt: str, max_tokens: int) -> Stream:
    return Stream().read(server.client(), greedy(prompt, max_tokens))


def difference(got: list[str], expected: list[str]) -> str:
    """Where two token lists part, for failure messages."""
    k = next((k for k, (a, b) in enumerate(zip(got, expected)) if a != b), min(len(got), len(expected)))
    return f"{len(got)} vs {len(expected)} tokens, from token {k}: {got[k:k + 4]} vs {expected[k:k + 4]}"


def assert_streamed(got: Stream, expected_ids: tuple[int, ...], tokenizer: Tokenizer, what: str) -> None:
    """The stream ended at its length with exactly `expected_ids`, token by token and as text."""
    assert (got.finish_reason, got.completion_tokens) == ("length", len(expected_ids)), what
    expected_tokens = [tokenizer.token_text(token_id) for token_id in expected_ids]
    assert got.tokens == expected_tokens, f"{what}: {difference(got.tokens, expected_tokens)}"
    assert got.text == tokenizer.decode(list(expected_ids)), what


@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_a_quantized_server_streams_the_engines_greedy_tokens(request, tokenizer, scheme: str):
    server: RunningServer = request.getfixturevalue(f"{scheme}_server")
    prompt = prompt_ids(server, PROMPTS[scheme])
    got = stream(server, PROMPTS[scheme], MAX_TOKENS)
    expected = in_process_tokens(scheme, prompt, MAX_TOKENS)
    assert expected != in_process_tokens(None, prompt, MAX_TOKENS), \
        f"the prompt must lead {scheme} and float32 to different texts, or the check proves little"
    assert got.text.strip(), server.log.read_text()
    assert_streamed(got, expected, tokenizer, f"the {scheme} server's stream against the {scheme} Engine's")
    assert quantized_lines(server) == [(1, num_quantized_linears(), scheme)], server.log.read_text()
    assert "Traceback" not in server.log.read_text()


@pytest.mark.parametrize("kv", ["adopted", "recomputed"])
def test_an_int8_stream_resumes_token_identical_after_the_worker_is_sigkilled(request, tokenizer, kv: str):
    server: RunningServer = request.getfixturevalue("int8_server" if kv == "adopted" else "int8_private_kv_server")
    prompt = PROMPTS["int8"]
    reference = stream(server, prompt, LONG_MAX_TOKENS)
    assert_streamed(reference, in_process_tokens("int8", prompt_ids(server, prompt), LONG_MAX_TOKENS), tokenizer,
                    "the fault-free int8 stream against the int8 Engine's")
    before, worker, recoveries = server.scrape(), server.worker_pid, len(recovery_figures(server))
    [faulted], [future] = run_streams(server, [greedy(prompt, LONG_MAX_TOKENS)])
    server.wait_for(lambda: len(faulted.tokens) >= KILL_AFTER_TOKENS, f"{KILL_AFTER_TOKENS} tokens streamed")
    os.kill(worker, signal.SIGKILL)
    killed_at = len(faulted.tokens)
    assert killed_at < LONG_MAX_TOKENS, "the worker must die mid-decode"
    future.result(timeout=WAIT_S)
    server.wait_for(server.is_healthy, "/health 200 after the restart")

    assert (faulted.finish_reason, faulted.completion_tokens) == ("length", LONG_MAX_TOKENS), server.log.read_text()
    assert faulted.tokens == reference.tokens, (f"killed at {killed_at} tokens: "
                                                f"{difference(faulted.tokens, reference.tokens)}")
    assert faulted.text == reference.text
    assert server.worker_pid != worker
    restarts = rise(before, server.scrape(), "pagedserve:worker_restarts_total", cause="signal",
                    model_name=DEFAULT_MODEL_NAME)
    assert restarts == 1, server.log.read_text()
    [(adopted, recomputed)] = recovery_figures(server)[recoveries:]
    assert (adopted if kv == "adopted" else recomputed) >= KILL_AFTER_TOKENS, (adopted, recomputed)
    assert [scheme for _, _, scheme in quantized_lines(server)][-2:] == ["int8", "int8"], \
        "the restarted worker quantizes its weights too"


@pytest.mark.parametrize("flag", ["--quantization", "-q"])
def test_an_unknown_scheme_stops_the_server_naming_int8_and_int4(tmp_path, flag: str):
    result = subprocess.run([sys.executable, "-m", "server", flag, "fp8", "--port", "0", "--runtime-dir",
                             str(tmp_path / "runtime")], capture_output=True, text=True, timeout=EXIT_TIMEOUT_S)
    assert result.returncode != 0, result.stdout + result.stderr
    assert INVALID_CHOICE.search(result.stderr), result.stderr
    assert "listening on" not in result.stdout + result.stderr
