"""The model's flags against `python -m server`: a Hugging Face id from a cache laid out here, the positional
MODEL, --tokenizer read by both the frontend and the worker, and a snapshot missing from the cache."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

from shared.vocabulary import TOKENIZER_FILE

from helpers.running_server import start_server, stop_server
from helpers.tiny_tokenizer import make_served_checkpoint

COMMIT = "0123456789abcdef0123456789abcdef01234567"
REPO_ID = "tiny-org/tiny-llama"
SERVER_FLAGS = ("--device", "cpu", "--dtype", "float32", "--num-kv-blocks", "256", "--max-num-seqs", "4",
                "--standby-workers", "0")
EXIT_TIMEOUT_S = 60


def lay_out_cache(tmp_path: Path) -> Path:
    """An HF_HOME whose hub cache holds REPO_ID at COMMIT, refs/main pointing at it."""
    hf_home = tmp_path / "hf"
    repo_dir = hf_home / "hub" / ("models--" + REPO_ID.replace("/", "--"))
    (repo_dir / "snapshots").mkdir(parents=True)
    checkpoint = make_served_checkpoint(tmp_path)
    shutil.move(checkpoint, repo_dir / "snapshots" / COMMIT)
    (repo_dir / "refs").mkdir()
    (repo_dir / "refs" / "main").write_text(COMMIT)
    return hf_home


def test_a_hugging_face_id_as_the_positional_model_serves_its_cached_snapshot(tmp_path: Path) -> None:
    hf_home = lay_out_cache(tmp_path)
    server = start_server(tmp_path, None, REPO_ID, *SERVER_FLAGS, env={"HF_HOME": str(hf_home), "HF_HUB_CACHE": ""})
    try:
        models = server.client().models.list()
        assert [m.id for m in models.data] == [REPO_ID]  # served under the id, as vLLM does
        completion = server.client().completions.create(model=REPO_ID, prompt="to be", max_tokens=4)
        assert completion.usage.completion_tokens == 4
    finally:
        stop_server(server)


def test_a_snapshot_missing_from_the_cache_exits_naming_the_path(tmp_path: Path) -> None:
    hf_home = lay_out_cache(tmp_path)
    result = subprocess.run([sys.executable, "-m", "server", "--model", "tiny-org/absent", "--port", "0"],
                            capture_output=True, text=True, timeout=EXIT_TIMEOUT_S,
                            env={"HF_HOME": str(hf_home), "PATH": "/usr/bin:/bin"})
    assert result.returncode != 0
    assert str(hf_home / "hub" / "models--tiny-org--absent") in result.stderr, result.stderr
    assert "downloads nothing" in result.stderr


def test_the_model_twice_and_different_is_refused(tmp_path: Path) -> None:
    result = subprocess.run([sys.executable, "-m", "server", "a/b", "--model", "c/d", "--port", "0"],
                            capture_output=True, text=True, timeout=EXIT_TIMEOUT_S)
    assert result.returncode != 0
    assert "'a/b' as MODEL and 'c/d' as --model" in result.stderr, result.stderr


def test_tokenizer_flag_feeds_the_frontend_and_the_worker(tmp_path: Path) -> None:
    """A checkpoint without tokenizer files serves text, and structured output, with --tokenizer's."""
    checkpoint = make_served_checkpoint(tmp_path)
    tokenizer_dir = tmp_path / "tokenizer"
    tokenizer_dir.mkdir()
    for name in (TOKENIZER_FILE, "tokenizer_config.json"):
        if (checkpoint / name).is_file():
            shutil.move(checkpoint / name, tokenizer_dir / name)
    server = start_server(tmp_path, checkpoint, "--tokenizer", str(tokenizer_dir), "--served-model-name", "tiny",
                          *SERVER_FLAGS)
    try:
        status, _, body = server.request("POST", "/tokenize", {"prompt": "to be"})
        assert status == 200 and json.loads(body)["count"] >= 2
        schema = {"type": "object", "required": ["ok"], "additionalProperties": False,
                  "properties": {"ok": {"type": "boolean"}}}
        completion = server.client().chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=32,
            response_format={"type": "json_schema", "json_schema": {"name": "ok", "schema": schema}})
        assert json.loads(completion.choices[0].message.content)["ok"] in (True, False)
    finally:
        stop_server(server)
