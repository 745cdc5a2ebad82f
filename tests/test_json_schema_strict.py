"""Strict JSON schemas (server/generation/json_schema_strict.py): what the grammar of a request allows.

Each case compiles the request's fields as the server does (server/api/structured_fields.py, then llguidance) and
checks whole outputs against the grammar with llguidance's own matcher: an unlisted key is refused by default,
allowed with `disable_additional_properties: false` or where the schema allows it, at any depth and through
$defs, the way pydantic writes nested models.
"""

from __future__ import annotations

import pydantic
import pytest

from server.api.completions.tool_fields import parse_tool_choice
from server.api.structured_fields import grammar_spec
from server.generation.json_schema_strict import forbid_unlisted_properties
from server.generation.structured_output import grammar_text
from server.http.errors import ApiError


class Address(pydantic.BaseModel):
    city: str


class User(pydantic.BaseModel):
    name: str
    age: int
    home: Address
    tags: dict[str, int]


USER = User.model_json_schema()  # no "additionalProperties" anywhere but the free-form dict
CLEAN = '{"name":"Ada","age":36,"home":{"city":"Oslo"},"tags":{"x":1}}'
EXTRA_TOP = '{"name":"Ada","age":36,"home":{"city":"Oslo"},"tags":{"x":1},"note":"hi"}'
EXTRA_NESTED = '{"name":"Ada","age":36,"home":{"city":"Oslo","zip":"0150"},"tags":{"x":1}}'


def response_format(schema: dict) -> dict:
    return {"response_format": {"type": "json_schema", "json_schema": {"name": "user", "schema": schema}}}


def structured_outputs(schema: dict, **options) -> dict:
    return {"structured_outputs": {"json": schema, **options}}


def test_pydantic_writes_no_additional_properties_so_the_default_decides():
    assert "additionalProperties" not in USER and "additionalProperties" not in USER["$defs"]["Address"]


@pytest.mark.parametrize("body", [response_format(USER), structured_outputs(USER), {"guided_json": USER},
                                  structured_outputs(USER, disable_additional_properties=True)],
                         ids=["response_format", "structured_outputs", "guided_json", "disable_true"])
def test_by_default_an_object_takes_only_the_keys_its_schema_lists_at_any_depth(accepts, body):
    grammar = grammar_text(grammar_spec(body))
    assert accepts(grammar, CLEAN)
    assert not accepts(grammar, EXTRA_TOP)
    assert not accepts(grammar, EXTRA_NESTED)
    assert accepts(grammar, '{"name":"Ada","age":36,"home":{"city":"Oslo"},"tags":{"x":1,"any key":2}}'), \
        "a dict field (additionalProperties: a schema) keeps its free keys"


def test_disable_additional_properties_false_gives_json_schemas_own_default_back(accepts):
    grammar = grammar_text(grammar_spec(structured_outputs(USER, disable_additional_properties=False)))
    assert accepts(grammar, CLEAN) and accepts(grammar, EXTRA_TOP) and accepts(grammar, EXTRA_NESTED)


def test_a_schema_that_allows_other_keys_keeps_them(accepts):
    schema = {**USER, "additionalProperties": True}
    grammar = grammar_text(grammar_spec(response_format(schema)))
    assert accepts(grammar, EXTRA_TOP) and not accepts(grammar, EXTRA_NESTED)
    typed = {**USER, "additionalProperties": {"type": "integer"}}
    grammar = grammar_text(grammar_spec(response_format(typed)))
    assert accepts(grammar, '{"name":"Ada","age":36,"home":{"city":"Oslo"},"tags":{},"extra":7}')
    assert not accepts(grammar, EXTRA_TOP)


def test_a_bare_object_schema_and_json_object_stay_any_object(accepts):
    for body in (response_format({"type": "object"}), {"response_format": {"type": "json_object"}}):
        assert accepts(grammar_text(grammar_spec(body)), '{"anything":[1,2],"else":null}')


def test_tool_parameters_follow_the_same_rule_when_forced():
    tool = {"type": "function", "function": {"name": "save_user", "parameters": USER}}
    for tool_choice in ("required", {"type": "function", "function": {"name": "save_user"}}):
        spec = parse_tool_choice({"tools": [tool], "tool_choice": tool_choice}).grammar_spec()
        assert spec.forbid_unlisted_properties


def test_forced_tool_calls_refuse_unlisted_arguments(accepts):
    tool = {"type": "function", "function": {"name": "save_user", "parameters": USER}}
    named = parse_tool_choice({"tools": [tool], "tool_choice": {"type": "function", "function": {"name": "save_user"}}})
    assert accepts(grammar_text(named.grammar_spec()), CLEAN)
    assert not accepts(grammar_text(named.grammar_spec()), EXTRA_NESTED)
    required = parse_tool_choice({"tools": [tool], "tool_choice": "required"})
    assert accepts(grammar_text(required.grammar_spec()), f'[{{"name":"save_user","parameters":{CLEAN}}}]')
    assert not accepts(grammar_text(required.grammar_spec()), f'[{{"name":"save_user","parameters":{EXTRA_TOP}}}]')


def test_the_rewrite_touches_schemas_only_where_they_list_properties():
    schema = {"type": "object", "properties": {"properties": {"type": "object", "properties": {"a": {}}}},
              "anyOf": [{"properties": {"b": {}}}, {"type": "string"}],
              "patternProperties": {"^x": {"type": "integer"}},
              "items": [{"properties": {"c": {}}}], "unevaluatedProperties": True}
    strict = forbid_unlisted_properties(schema)
    assert "additionalProperties" not in strict, "unevaluatedProperties speaks for the others"
    assert strict["properties"]["properties"]["additionalProperties"] is False, "a property named properties"
    assert set(strict["properties"]) == {"properties"}, "no key is added to a map of property names"
    assert strict["anyOf"] == [{"properties": {"b": {}}, "additionalProperties": False}, {"type": "string"}]
    assert strict["items"][0]["additionalProperties"] is False
    assert "additionalProperties" not in schema["properties"]["properties"], "the request's schema is not changed"


@pytest.mark.parametrize("value", ["no", 1])
def test_disable_additional_properties_must_be_a_boolean(value):
    with pytest.raises(ApiError) as info:
        grammar_spec(structured_outputs(USER, disable_additional_properties=value))
    assert info.value.status == 400 and info.value.param == "structured_outputs.disable_additional_properties"
