"""vLLM's command-line flags as pagedserve reads them: several names and keys, the positional model, and the flags
accepted for what this server always does (a value asking for something else is refused)."""

from __future__ import annotations

import ssl

import pytest

from server.__main__ import API_KEY_ENV, build_parser, server_config_from_args
from server.api.root_path import check_root_path, strip_root_path
from server.server import ServerConfig
from shared.default_model import DEFAULT_MODEL_NAME


def config_of(*argv: str) -> ServerConfig:
    return server_config_from_args(build_parser().parse_args(argv))


def test_several_served_model_names_report_the_first() -> None:
    config = config_of("--served-model-name", "tiny", "alias", "--served-model-name", "third")
    assert config.model_names == ("tiny", "alias", "third")
    assert config.model_name == "tiny"
    assert config_of().model_names == (DEFAULT_MODEL_NAME,)


def test_several_api_keys_listed_or_repeated(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(API_KEY_ENV, "from-env")
    assert config_of("--api-key", "k1", "k2", "--api-key", "k3").api_keys == ("k1", "k2", "k3")
    assert config_of().api_keys == ("from-env",)
    monkeypatch.delenv(API_KEY_ENV)
    assert config_of().api_keys == ()


def test_the_positional_model_is_the_model(tmp_path) -> None:
    config = config_of(str(tmp_path))
    assert config.engine.model == str(tmp_path)
    assert config.model_name == str(tmp_path)  # served under the value as given
    assert config_of(str(tmp_path), "--model", str(tmp_path)).engine.model == str(tmp_path)
    with pytest.raises(ValueError, match="given twice"):
        config_of(str(tmp_path), "--model", str(tmp_path / "other"))


def test_a_model_written_after_a_flag_of_several_values_is_an_error_not_a_key(tmp_path) -> None:
    for flag in ("--api-key", "--served-model-name"):
        with pytest.raises(ValueError, match="put MODEL first"):
            config_of(flag, "secret", str(tmp_path))
    assert config_of(str(tmp_path), "--api-key", "secret").api_keys == ("secret",)


def test_implied_flags_are_accepted() -> None:
    config = config_of("--enable-chunked-prefill", "--enforce-eager", "--kv-cache-dtype", "auto",
                       "--disable-log-requests", "--disable-log-stats", "--uvicorn-log-level", "debug")
    assert config.engine.model  # parsed and built, nothing else changes


@pytest.mark.parametrize(("argv", "message"), [
    (("--kv-cache-dtype", "fp8"), "--kv-cache-dtype supports only 'auto'.*got 'fp8'"),
    (("--no-enable-chunked-prefill",), "prefill is always chunked"),
])
def test_implied_flags_asking_for_something_else_are_refused(argv: tuple[str, ...], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        config_of(*argv)


def test_tls_flags(tmp_path) -> None:
    cert = ("--ssl-certfile", str(tmp_path / "cert.pem"), "--ssl-keyfile", str(tmp_path / "key.pem"))
    assert config_of().tls is None
    tls = config_of(*cert).tls
    assert tls is not None and tls.client_cert_reqs is ssl.CERT_NONE
    tls = config_of(*cert, "--ssl-ca-certs", str(tmp_path / "ca.pem")).tls
    assert tls is not None and tls.client_cert_reqs is ssl.CERT_REQUIRED  # client certificates, once a CA is given
    tls = config_of(*cert, "--ssl-ca-certs", str(tmp_path / "ca.pem"), "--ssl-cert-reqs", "1").tls
    assert tls is not None and tls.client_cert_reqs is ssl.CERT_OPTIONAL
    with pytest.raises(ValueError, match="go together"):
        config_of(*cert[:2])
    with pytest.raises(ValueError, match="need HTTPS"):
        config_of("--ssl-ca-certs", str(tmp_path / "ca.pem"))
    with pytest.raises(ValueError, match="needs ssl_ca_certs"):
        config_of(*cert, "--ssl-cert-reqs", "2")


def test_uvicorn_log_level_takes_vllm_values() -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--uvicorn-log-level", "loud"])


def test_root_path_strips_whole_segments() -> None:
    root = check_root_path("/llm/")
    assert [strip_root_path(p, root) for p in ("/llm/v1/models", "/llm", "/v1/models", "/llmx/v1")] == \
        ["/v1/models", "/", "/v1/models", "/llmx/v1"]
    with pytest.raises(ValueError, match="must start with '/'"):
        config_of("--root-path", "llm")


def test_recycling_limits_reach_the_policy_in_bytes() -> None:
    policy = config_of("--worker-memory-limit", "1500MB", "--worker-cuda-memory-limit", "75GiB",
                       "--worker-max-requests", "50").recycle_policy
    assert (policy.memory_limit, policy.cuda_memory_limit, policy.max_requests) == (1500 * 10**6, 75 * 2**30, 50)
    assert not config_of().recycle_policy.is_on
