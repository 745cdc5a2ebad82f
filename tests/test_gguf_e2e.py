"""`pagedserve model.gguf` against `python -m server`: the embedded default model written as a Q8_0 GGUF file (its
linear layers and its tied embedding table in Q8_0, as llama.cpp's Q8_0 files have them; helpers/gguf_checkpoints.py
spells out the packing), read through the openai SDK.

What must hold: the server starts from the file alone, named in the API by
the path it was given; its worker reads every linear layer from the file's
blocks onto the int8 kernel and says so; a greedy stream carries exactly the
tokens the in-process Engine computes from the same file, text and token by
token, the prompt tokenized by the tokenizer rebuilt from the file's
metadata (the same ids the checkpoint's own tokenizer gives); and a chat
completion renders the chat template the file carries.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpu_worker.engine.engine import Engine
from gpu_worker.engine.generate import generate
from server.generation.tokenizer import Tokenizer
from shared.config import EngineConfig
from shared.default_model import DEFAULT_MODEL_DIR
from shared.gguf_model.unpack import unpacked_dir
from shared.sampling_params import SamplingParams

from helpers.completion_streams import Stream
from helpers.gguf_checkpoints import write_gguf
from helpers.running_server import RunningServer, start_server, stop_server

PROMPT = "KING HENRY:"
MAX_TOKENS = 24
FLAGS = ("--device", "cpu", "--dtype", "float32", "--standby-workers", "0", "--target-itl-ms", "0")
READ = re.compile(r"worker\[\d+\] epoch 1 INFO read (\d+) linear layers from GGUF blocks of 32 as int8\n")


@pytest.fixture(scope="module")
def gguf_model(tmp_path_factory) -> tuple[Path, Path]:
    """(the Q8_0 file, the cache its metadata is unpacked under)."""
    tmp = tmp_path_factory.mktemp("gguf")
    file, _ = write_gguf(DEFAULT_MODEL_DIR, tmp / "shakespeare-q8_0.gguf", "Q8_0", embedding_type="Q8_0")
    return file, tmp / "cache"


@pytest.fixture(scope="module")
def server(tmp_path_factory, gguf_model) -> Iterator[RunningServer]:
    file, cache = gguf_model
    running = start_server(tmp_path_factory.mktemp("server"), None, str(file), *FLAGS,
                           env={"XDG_CACHE_HOME": str(cache)})
    try:
        yield running
    finally:
        stop_server(running)


def engine_tokens(directory: Path, prompt: list[int]) -> list[int]:
    engine = Engine(EngineConfig(model=str(directory), dtype="float32", device="cpu", num_kv_blocks=64,
                                 target_itl_ms=0))
    [completion] = generate(engine, [prompt], SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True))
    return completion.token_ids


def test_a_q8_0_file_streams_the_engines_greedy_tokens(server, gguf_model):
    file, cache = gguf_model
    directory = unpacked_dir(file, cache / "pagedserve" / "gguf")
    tokenizer = Tokenizer.from_dir(directory)
    prompt = server.post_ok("/tokenize", {"model": str(file), "prompt": PROMPT})["tokens"]
    assert prompt == Tokenizer.from_dir(DEFAULT_MODEL_DIR).encode(PROMPT), "the metadata's tokenizer is the model's"
    got = Stream().read(server.client(), {"model": str(file), "prompt": PROMPT, "max_tokens": MAX_TOKENS,
                                          "temperature": 0, "logprobs": 0, "extra_body": {"ignore_eos": True}})
    expected = engine_tokens(directory, prompt)
    assert (got.finish_reason, got.completion_tokens) == ("length", MAX_TOKENS), server.log.read_text()
    assert got.tokens == [tokenizer.token_text(token) for token in expected]
    assert got.text == tokenizer.decode(expected) and got.text.strip()
    config = json.loads((DEFAULT_MODEL_DIR / "config.json").read_text())
    assert [int(count) for count in READ.findall(server.log.read_text())] == [4 * config["num_hidden_layers"] + 1], \
        server.log.read_text()
    assert "Traceback" not in server.log.read_text()


def test_the_models_list_names_the_file_and_chat_uses_its_template(server, gguf_model):
    file, _ = gguf_model
    client = server.client()
    assert [model.id for model in client.models.list()] == [str(file)]
    messages = [{"role": "user", "content": "Who is the king?"}]
    rendered = server.post_ok("/tokenize", {"model": str(file), "messages": messages,
                                            "add_generation_prompt": True})["tokens"]
    template_text = Tokenizer.from_dir(DEFAULT_MODEL_DIR).decode(rendered)
    assert template_text.endswith("USER:\nWho is the king?\n\nASSISTANT:\n"), template_text
    reply = client.chat.completions.create(model=str(file), messages=messages, max_tokens=16, temperature=0)
    assert reply.choices[0].message.content and reply.usage and reply.usage.prompt_tokens == len(rendered)
