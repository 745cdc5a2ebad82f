"""The request-field table of /v1/completions and /v1/chat/completions (server/api/completions/fields.py).

Through the real parsers: every implemented field is read (a value of the
wrong type is a 400 naming it), every harmless field changes nothing, every
field not implemented is a 400 naming it unless it carries its neutral value,
and an unknown field is accepted and logged once per name.
"""

from __future__ import annotations

import logging

import pytest

from server.api.completions import fields
from server.api.completions.fields import HARMLESS, IMPLEMENTED, NOT_IMPLEMENTED, Endpoint
from server.api.completions.params import parse_chat_request, parse_completion_request
from server.http.errors import ApiError

BASE = {Endpoint.COMPLETIONS: {"prompt": "hi"}, Endpoint.CHAT: {"messages": [{"role": "user", "content": "hi"}]}}
PARSE = {Endpoint.COMPLETIONS: parse_completion_request, Endpoint.CHAT: parse_chat_request}
NOT_A_VALUE = {"surely": ["not", "a", "value", "of", "this", "field"]}  # wrong type for the implemented fields...
WRONG_TYPE = {"chat_template_kwargs": ["not", "an", "object"]}  # ...but these, which take an object
READ_ELSEWHERE = {"prompt", "messages",  # required, read as they are; their checks run later (prompts, the template)
                  "guided_json"}  # any object is a schema: whether it compiles is the GrammarCompiler's to say
ENDPOINTS = list(Endpoint)


def _parse(endpoint: Endpoint, **fields):
    return PARSE[endpoint]({**BASE[endpoint], **fields})


@pytest.mark.parametrize("endpoint", ENDPOINTS)
def test_every_implemented_field_is_read(endpoint):
    for name in sorted(IMPLEMENTED[endpoint] - READ_ELSEWHERE):
        with pytest.raises(ApiError) as info:
            _parse(endpoint, **{name: WRONG_TYPE.get(name, NOT_A_VALUE)})
        assert info.value.status == 400 and info.value.param.split(".")[0] == name, name


@pytest.mark.parametrize("endpoint", ENDPOINTS)
def test_every_field_not_implemented_is_a_400_naming_it_unless_neutral(endpoint):
    for name, neutral in NOT_IMPLEMENTED[endpoint].items():
        with pytest.raises(ApiError) as info:
            _parse(endpoint, **{name: NOT_A_VALUE})
        assert (info.value.status, info.value.param) == (400, name)
        assert "not supported" in info.value.message
        for value in neutral:
            _parse(endpoint, **{name: 1 if value == "n" else value})  # "n": the request's own n, 1 here
        _parse(endpoint, **{name: None})  # null is absent


def test_best_of_is_neutral_only_at_the_requests_own_n():
    assert parse_completion_request({"prompt": "hi", "n": 3, "best_of": 3}).n == 3
    with pytest.raises(ApiError) as info:
        parse_completion_request({"prompt": "hi", "n": 1, "best_of": 3})
    assert info.value.param == "best_of"


@pytest.mark.parametrize("endpoint", ENDPOINTS)
def test_harmless_fields_change_nothing(endpoint):
    plain = _parse(endpoint)
    for name in HARMLESS[endpoint]:
        assert _parse(endpoint, **{name: "anything"}) == plain, name


@pytest.mark.parametrize("endpoint", ENDPOINTS)
def test_the_kinds_do_not_overlap(endpoint):
    implemented, harmless, not_implemented = IMPLEMENTED[endpoint], HARMLESS[endpoint], set(NOT_IMPLEMENTED[endpoint])
    assert not (implemented & harmless) and not (implemented & not_implemented) and not (harmless & not_implemented)


@pytest.mark.parametrize("endpoint", ENDPOINTS)
def test_an_unknown_field_is_accepted_and_logged_once_per_name(endpoint, caplog):
    name = f"field_no_one_knows_{endpoint.name.lower()}"
    with caplog.at_level(logging.WARNING, logger="pagedserve.api"):
        assert _parse(endpoint, **{name: 1}) == _parse(endpoint)
        _parse(endpoint, **{name: 2})
        _parse(endpoint, **{f"{name}_too": 3})
    warnings = [r.getMessage() for r in caplog.records if r.name == "pagedserve.api"]
    assert [name in w for w in warnings].count(True) == 2 and len(warnings) == 2  # one each for the two names


@pytest.mark.parametrize("endpoint", ENDPOINTS)
def test_stream_options_needs_stream(endpoint):
    with pytest.raises(ApiError) as info:
        _parse(endpoint, stream_options={"include_usage": True})
    assert info.value.param == "stream_options"
    assert _parse(endpoint, stream=True, stream_options={"include_usage": True}).include_usage


def test_a_client_inventing_field_names_cannot_grow_the_memory_or_flood_the_log(monkeypatch, caplog):
    monkeypatch.setattr(fields, "_warned", set())
    monkeypatch.setattr(fields, "MAX_WARNED_NAMES", 3)
    with caplog.at_level(logging.WARNING, logger="pagedserve.api"):
        for i in range(50):
            parse_completion_request({"prompt": "hi", f"invented_{i}": i})
    warnings = [r.getMessage() for r in caplog.records if r.name == "pagedserve.api"]
    assert len(warnings) == 3 and "no more are logged" in warnings[-1] and len(fields._warned) == 3


def test_chat_template_fields_are_read():
    request = parse_chat_request({**BASE[Endpoint.CHAT], "add_generation_prompt": False, "continue_final_message": True,
                                  "chat_template": "{{ messages }}", "chat_template_kwargs": {"enable_thinking": False}})
    assert (request.add_generation_prompt, request.continue_final_message) == (False, True)
    assert (request.chat_template, request.chat_template_kwargs) == ("{{ messages }}", {"enable_thinking": False})
    plain = parse_chat_request(BASE[Endpoint.CHAT])
    assert (plain.add_generation_prompt, plain.continue_final_message, plain.chat_template,
            plain.chat_template_kwargs) == (True, False, None, {})


@pytest.mark.parametrize("fields", [{"continue_final_message": True, "add_generation_prompt": True},
                                    {"continue_final_message": True}])  # add_generation_prompt defaults to true
def test_continue_final_message_needs_add_generation_prompt_false(fields):
    with pytest.raises(ApiError) as info:
        _parse(Endpoint.CHAT, **fields)
    assert (info.value.status, info.value.param) == (400, "continue_final_message")
    assert "Cannot set both `continue_final_message` and `add_generation_prompt`" in info.value.message


@pytest.mark.parametrize("name", ["messages", "tools", "add_generation_prompt", "continue_final_message",
                                  "chat_template", "tokenize"])
def test_chat_template_kwargs_cannot_set_what_the_request_sets(name):
    with pytest.raises(ApiError) as info:
        _parse(Endpoint.CHAT, chat_template_kwargs={"enable_thinking": True, name: False})
    assert (info.value.status, info.value.param) == (400, f"chat_template_kwargs.{name}")
