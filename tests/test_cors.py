"""CorsPolicy and its flags: what a preflight is allowed, what the answer names, and CORS off by default.

The policy's answers through a real server are in test_vllm_endpoints.py.
"""

from __future__ import annotations

import pytest

from server.__main__ import build_parser
from server.api.cors import CorsPolicy, cors_policy_from_args

ORIGIN = "https://app.example"


def policy_from(*flags: str) -> CorsPolicy | None:
    return cors_policy_from_args(build_parser().parse_args(list(flags)))


def test_cors_is_off_without_allowed_origins():
    assert policy_from() is None


@pytest.mark.parametrize("flag", [("--allowed-methods", '["GET"]'), ("--allowed-headers", '["X-Key"]'),
                                  ("--allow-credentials",)])
def test_the_other_flags_need_allowed_origins(flag):
    with pytest.raises(ValueError, match="needs --allowed-origins"):
        policy_from(*flag)


def test_a_flag_that_is_no_json_list_is_a_usage_error():
    with pytest.raises(SystemExit):
        policy_from("--allowed-origins", "https://app.example")


def test_any_origin_without_credentials_is_a_star():
    policy = policy_from("--allowed-origins", '["*"]')
    assert policy.allows_origin("https://anything.example")
    assert policy.origin_headers(ORIGIN) == {"Access-Control-Allow-Origin": "*"}


def test_credentials_name_the_origin_never_a_star():
    policy = policy_from("--allowed-origins", '["*"]', "--allow-credentials")
    assert policy.origin_headers(ORIGIN) == {"Access-Control-Allow-Origin": ORIGIN, "Vary": "Origin",
                                             "Access-Control-Allow-Credentials": "true"}


def test_a_preflight_is_held_to_the_allowed_methods_and_headers():
    policy = policy_from("--allowed-origins", f'["{ORIGIN}"]', "--allowed-methods", '["GET", "post"]',
                         "--allowed-headers", '["Authorization"]')
    headers = policy.preflight_headers(ORIGIN, "POST", "authorization, content-type")  # content-type: safelisted
    assert headers is not None and headers["Access-Control-Allow-Methods"] == "GET, POST"
    assert headers["Access-Control-Allow-Headers"] == "Accept, Accept-Language, Authorization, Content-Language, " \
                                                      "Content-Type"
    assert policy.preflight_headers(ORIGIN, "DELETE", "") is None
    assert policy.preflight_headers(ORIGIN, "GET", "x-custom") is None
    assert policy.preflight_headers("https://elsewhere.example", "GET", "") is None
