"""The checkpoint's generation defaults (--generation-config, --override-generation-config), as vLLM applies them.

The parsing and merging rules on their own first; then real servers on a tiny random checkpoint whose
generation_config.json the test writes, with near-uniform logits so that any change of a sampling value
changes the tokens drawn: a request that leaves the values out draws what one giving the file's values
draws, with the same seed; `--generation-config vllm` draws what the neutral values draw; the override
wins; the Responses object reports the values used. Bad flags and files stop the server at start-up.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from server.generation.generation_defaults import (
    GenerationDefaults,
    check_override,
    generation_config_path,
    load_generation_defaults,
    parse_override,
)

from helpers.running_server import RunningServer, start_server, stop_server
from helpers.tiny_tokenizer import make_served_checkpoint

MODEL = "tiny"
FILE_VALUES = {"temperature": 0.5, "top_p": 0.8, "top_k": 5, "max_new_tokens": 7}
EXPLICIT = {"temperature": 0.5, "top_p": 0.8, "top_k": 5, "max_tokens": 7}  # FILE_VALUES as a request spells them
NEUTRAL = {"temperature": 1.0, "top_p": 1.0, "top_k": -1}
OVERRIDE = {"temperature": 1.5, "top_k": None}  # over FILE_VALUES: temperature 1.5, top_p 0.8, no top-k, 7 tokens
SEED = 11


# ---------------------------------------------------------------------------------------------- the rules

def test_the_file_gives_its_sampling_keys_and_max_new_tokens_only(tmp_path):
    path = tmp_path / "generation_config.json"
    path.write_text(json.dumps({"do_sample": True, "bos_token_id": 1, "eos_token_id": [2, 3], "top_k": 0,
                                "min_p": 0.1, "repetition_penalty": 1.2, "max_new_tokens": 64, "temperature": None}))
    defaults = load_generation_defaults(path, {})
    assert defaults == GenerationDefaults({"min_p": 0.1, "repetition_penalty": 1.2}, 64)  # top_k 0 is "off"


def test_the_override_replaces_keys_one_by_one_and_null_restores_the_neutral_value(tmp_path):
    path = tmp_path / "generation_config.json"
    path.write_text(json.dumps(FILE_VALUES))
    defaults = load_generation_defaults(path, {"temperature": 0.2, "top_p": None})
    assert defaults == GenerationDefaults({"temperature": 0.2, "top_k": 5}, 7)
    assert load_generation_defaults(None, {"top_p": 0.9}) == GenerationDefaults({"top_p": 0.9})  # vllm: override only


def test_where_the_file_is_found(tmp_path):
    assert generation_config_path("vllm", str(tmp_path)) is None
    assert generation_config_path("auto", str(tmp_path)) == tmp_path / "generation_config.json"
    assert load_generation_defaults(generation_config_path("auto", str(tmp_path)), {}) == GenerationDefaults()
    with pytest.raises(ValueError, match="--generation-config: expected auto, vllm or a directory holding"):
        generation_config_path(str(tmp_path / "elsewhere"), str(tmp_path))
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "elsewhere" / "generation_config.json").write_text("{}")
    assert generation_config_path(str(tmp_path / "elsewhere"), "unused") == tmp_path / "elsewhere" / "generation_config.json"


@pytest.mark.parametrize("override, message", [
    ({"temprature": 0.5}, "--override-generation-config takes temperature, top_p, top_k, min_p, repetition_penalty, "
                          "max_new_tokens, got 'temprature'"),
    ({"temperature": -1}, "--override-generation-config: temperature must be a number >= 0, got -1"),
    ({"top_p": "high"}, "--override-generation-config: top_p must be a number in (0, 1], got 'high'"),
    ({"max_new_tokens": 0}, "--override-generation-config: max_new_tokens must be an integer >= 1, got 0"),
])
def test_a_bad_override_is_refused_naming_the_flag_and_the_value(override, message):
    with pytest.raises(ValueError) as error:
        check_override(override)
    assert str(error.value) == message


@pytest.mark.parametrize("text", ["temperature=0.5", "[1]", "{'temperature': 0.5}"])
def test_an_override_that_is_no_json_object_is_refused(text):
    with pytest.raises(ValueError, match="--override-generation-config must be a JSON object, got"):
        parse_override(text)


def test_a_bad_value_in_the_file_names_the_file(tmp_path):
    path = tmp_path / "generation_config.json"
    path.write_text(json.dumps({"top_p": 0}))
    with pytest.raises(ValueError, match=f"{path}: top_p must be a number in"):
        load_generation_defaults(path, {})


# ---------------------------------------------------------------------------------------------- real servers

@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    # Not sharpened: near-uniform logits, so that every sampling value moves the draws.
    path = make_served_checkpoint(tmp_path_factory.mktemp("checkpoint"), sharpen=1.0)
    generation = json.loads((path / "generation_config.json").read_text())
    (path / "generation_config.json").write_text(json.dumps({**generation, **FILE_VALUES}))
    return path


def _server(tmp_path_factory, checkpoint: Path, *flags: str):
    running = start_server(tmp_path_factory.mktemp("server"), checkpoint, "--served-model-name", MODEL,
                           "--device", "cpu", "--dtype", "float32", "--standby-workers", "0", *flags)
    yield running
    stop_server(running)


@pytest.fixture(scope="module")
def auto_server(tmp_path_factory, checkpoint):
    yield from _server(tmp_path_factory, checkpoint)


@pytest.fixture(scope="module")
def neutral_server(tmp_path_factory, checkpoint):
    yield from _server(tmp_path_factory, checkpoint, "--generation-config", "vllm")


@pytest.fixture(scope="module")
def override_server(tmp_path_factory, checkpoint):
    yield from _server(tmp_path_factory, checkpoint, "--override-generation-config", json.dumps(OVERRIDE))


def completion(server: RunningServer, **fields) -> tuple[list[int], str]:
    """(the tokens drawn, the finish reason) for a fixed prompt and SEED."""
    status, _, body = server.request("POST", "/v1/completions", {
        "model": MODEL, "prompt": "Once upon a time", "seed": SEED, "ignore_eos": True, "logprobs": 0, **fields})
    assert status == 200, body
    [choice] = json.loads(body)["choices"]
    return choice["logprobs"]["tokens"], choice["finish_reason"]


def chat(server: RunningServer, extra: dict | None = None, **fields) -> str:
    """The text drawn for a fixed message and SEED; extra: vLLM's fields (top_k), which the SDK takes as extra_body."""
    response = server.client().chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Once upon a time"}], seed=SEED,
        extra_body={"ignore_eos": True, **(extra or {})}, **fields)
    return response.choices[0].message.content or ""


def test_a_request_without_values_draws_what_the_files_values_draw(auto_server):
    tokens, finish_reason = completion(auto_server)
    assert (tokens, finish_reason) == completion(auto_server, **EXPLICIT)
    assert len(tokens) == FILE_VALUES["max_new_tokens"] and finish_reason == "length"  # not the endpoint's 16
    assert tokens != completion(auto_server, **{**EXPLICIT, **NEUTRAL})[0]
    explicit = {"temperature": 0.5, "top_p": 0.8, "max_tokens": 7, "extra": {"top_k": 5}}
    assert chat(auto_server) == chat(auto_server, **explicit)
    assert chat(auto_server) != chat(auto_server, temperature=1.0, top_p=1.0, max_tokens=7, extra={"top_k": -1})


def test_generation_config_vllm_ignores_the_file(auto_server, neutral_server):
    tokens, _ = completion(neutral_server, max_tokens=7)
    assert tokens == completion(auto_server, max_tokens=7, **NEUTRAL)[0]
    assert tokens != completion(auto_server, max_tokens=7)[0]
    assert len(completion(neutral_server)[0]) == 16  # the completions endpoint's own default max_tokens


def test_the_override_wins_over_the_file(auto_server, override_server):
    tokens, _ = completion(override_server)
    assert tokens == completion(auto_server, temperature=1.5, top_p=0.8, top_k=-1, max_tokens=7)[0]
    assert tokens != completion(auto_server)[0]


def test_the_responses_object_reports_the_values_used(auto_server, override_server):
    seeded = {"model": MODEL, "input": "Once upon a time", "extra_body": {"seed": SEED}}
    client = auto_server.client()
    response = client.responses.create(**seeded)
    assert (response.temperature, response.top_p) == (0.5, 0.8) and response.usage.output_tokens <= 7
    response = client.responses.create(**seeded, temperature=0.3, top_p=0.6)
    assert (response.temperature, response.top_p) == (0.3, 0.6)
    response = override_server.client().responses.create(**seeded)
    assert (response.temperature, response.top_p) == (1.5, 0.8)


def test_the_start_up_log_says_where_the_defaults_came_from(auto_server, neutral_server, override_server, checkpoint):
    assert (f"default sampling parameters have been overridden by the model's Hugging Face generation config "
            f"{checkpoint / 'generation_config.json'}") in auto_server.log.read_text()
    assert ("default sampling parameters in use: temperature=0.5, top_p=0.8, top_k=5, max_tokens=7"
            in auto_server.log.read_text())
    assert ("default sampling parameters: the neutral ones (--generation-config vllm)"
            in neutral_server.log.read_text())
    log = override_server.log.read_text()
    assert '--override-generation-config {"temperature": 1.5, "top_k": null} merged over them' in log
    assert "default sampling parameters in use: temperature=1.5, top_p=0.8, max_tokens=7" in log


@pytest.mark.parametrize("flags, exit_status, reason", [
    (("--override-generation-config", "temperature=0.5"), 2, "--override-generation-config must be a JSON object"),
    (("--override-generation-config", '{"temprature": 0.5}'), 2, "got 'temprature'"),
    (("--override-generation-config", '{"top_k": 2.5}'), 2,
     "--override-generation-config: top_k must be None or an integer"),
    (("--generation-config", "/nonexistent"), 1, "cannot start: --generation-config: expected auto, vllm or a directory"),
])
def test_a_bad_generation_config_stops_the_server_at_start(tmp_path, flags, exit_status, reason):
    result = subprocess.run([sys.executable, "-m", "server", "--port", "0", "--runtime-dir", str(tmp_path / "runtime"),
                             *flags], capture_output=True, text=True, timeout=60)
    output = result.stdout + result.stderr
    assert result.returncode == exit_status and reason in output, output
    assert "listening on" not in output
