"""vLLM's server flags against `python -m server`: several served names and API keys, --root-path, and the flags
accepted for what this server always does, all on one command line as a vLLM user would write it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import openai
import pytest

from helpers.running_server import start_server, stop_server
from helpers.tiny_tokenizer import make_served_checkpoint

NAMES = ("tiny", "tiny-alias")
KEYS = ("key-one", "key-two")
SERVER_FLAGS = ("--device", "cpu", "--dtype", "float32", "--num-kv-blocks", "256", "--max-num-seqs", "4",
                "--standby-workers", "0", "--served-model-name", *NAMES, "--api-key", *KEYS,
                "--enable-chunked-prefill", "--enforce-eager", "--kv-cache-dtype", "auto", "--disable-log-requests",
                "--disable-log-stats", "--uvicorn-log-level", "debug", "--root-path", "/llm/")


def test_several_names_keys_and_a_root_path(tmp_path: Path) -> None:
    server = start_server(tmp_path, make_served_checkpoint(tmp_path), *SERVER_FLAGS)
    try:
        assert [m.id for m in server.client(KEYS[1]).models.list().data] == list(NAMES)
        assert server.client(KEYS[0]).models.retrieve(NAMES[1]).id == NAMES[1]
        for key, name in zip(KEYS, NAMES[::-1], strict=True):
            completion = server.client(key).completions.create(model=name, prompt="to be", max_tokens=2)
            assert completion.model == NAMES[0]  # whichever name was asked for, the first is reported
        with pytest.raises(openai.AuthenticationError):
            server.client("key-three").models.list()
        with pytest.raises(openai.NotFoundError):
            server.client(KEYS[0]).completions.create(model="other", prompt="to be", max_tokens=2)
        behind_proxy = openai.OpenAI(base_url=f"{server.base_url}/llm/v1", api_key=KEYS[0], max_retries=0)
        assert behind_proxy.completions.create(model=NAMES[0], prompt="to be", max_tokens=2).model == NAMES[0]
        assert server.request("GET", "/llm/v1/models")[0] == 401  # the API key guards the prefixed path too
        assert server.get("/llm/health")[0] == 200
        assert server.get("/llmx/health")[0] == 404  # the prefix is a whole segment
    finally:
        stop_server(server)


@pytest.mark.parametrize(("level", "is_logged"), [("error", True), ("critical", False)])
def test_uvicorn_log_level_sets_the_level_of_the_log(tmp_path: Path, level: str, is_logged: bool) -> None:
    """A checkpoint that is not there: start-up fails with an ERROR line, shown at "error" and not at "critical"."""
    result = subprocess.run([sys.executable, "-m", "server", "--model", str(tmp_path / "absent"), "--port", "0",
                             "--uvicorn-log-level", level], capture_output=True, text=True, timeout=60)
    assert result.returncode == 1
    assert ("cannot start" in result.stderr) is is_logged, result.stderr
