"""Hugging Face ids resolve from the local Hugging Face cache: which cache, which snapshot, and the miss."""

from __future__ import annotations

from pathlib import Path

import pytest

from shared.model_source import hf_cache_dir, resolve_model_dir

COMMIT = "0123456789abcdef0123456789abcdef01234567"
OTHER_COMMIT = "fedcba9876543210fedcba9876543210fedcba98"


def lay_out_snapshot(cache: Path, repo_id: str, commit: str, ref: str | None = "main") -> Path:
    """models--org--name/snapshots/<commit>/ with refs/<ref> pointing at it, as huggingface_hub writes them."""
    repo_dir = cache / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo_dir / "snapshots" / commit
    snapshot.mkdir(parents=True)
    if ref is not None:
        (repo_dir / "refs").mkdir(exist_ok=True)
        (repo_dir / "refs" / ref).write_text(commit)
    return snapshot


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    for name in ("HF_HUB_CACHE", "HF_HOME", "XDG_CACHE_HOME"):
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def test_cache_dir_follows_huggingface_hub_order(clean_env: pytest.MonkeyPatch, tmp_path: Path) -> None:
    clean_env.setenv("HOME", str(tmp_path / "home"))
    assert hf_cache_dir() == tmp_path / "home" / ".cache" / "huggingface" / "hub"
    clean_env.setenv("HF_HOME", str(tmp_path / "hf"))
    assert hf_cache_dir() == tmp_path / "hf" / "hub"
    clean_env.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    assert hf_cache_dir() == tmp_path / "hub"
    assert hf_cache_dir(str(tmp_path / "downloads")) == tmp_path / "downloads"


def test_revision_picks_the_snapshot_its_ref_names(clean_env: pytest.MonkeyPatch, tmp_path: Path) -> None:
    clean_env.setenv("HF_HUB_CACHE", str(tmp_path))
    main = lay_out_snapshot(tmp_path, "org/name", COMMIT)
    other = lay_out_snapshot(tmp_path, "org/name", OTHER_COMMIT, ref="v2")
    assert resolve_model_dir("org/name") == str(main)
    assert resolve_model_dir("org/name", "v2") == str(other)
    assert resolve_model_dir("org/name", OTHER_COMMIT) == str(other)  # a commit hash is its own snapshot


def test_download_dir_is_the_cache_searched(clean_env: pytest.MonkeyPatch, tmp_path: Path) -> None:
    clean_env.setenv("HF_HUB_CACHE", str(tmp_path / "elsewhere"))
    snapshot = lay_out_snapshot(tmp_path / "downloads", "name-only", COMMIT)
    assert resolve_model_dir("name-only", download_dir=str(tmp_path / "downloads")) == str(snapshot)


def test_a_directory_is_itself_even_when_it_looks_like_an_id(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "org" / "name").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    assert resolve_model_dir("org/name") == "org/name"
    assert resolve_model_dir(str(tmp_path / "missing" / "dir")) == str(tmp_path / "missing" / "dir")


def test_a_missing_snapshot_names_the_path_searched(clean_env: pytest.MonkeyPatch, tmp_path: Path) -> None:
    clean_env.setenv("HF_HUB_CACHE", str(tmp_path))
    lay_out_snapshot(tmp_path, "org/name", COMMIT)
    with pytest.raises(ValueError, match="downloads nothing") as missing_repo:
        resolve_model_dir("org/absent")
    assert str(tmp_path / "models--org--absent") in str(missing_repo.value)
    with pytest.raises(ValueError, match="revision 'v9'"):
        resolve_model_dir("org/name", "v9")
