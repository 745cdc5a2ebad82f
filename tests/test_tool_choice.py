"""Tool calling's request side and forced choices: tools / tool_choice / parallel_tool_calls read into a ToolChoice
(server/api/completions/tool_fields.py), the grammar a forced choice becomes (server/generation/tool_calling.py,
checked by llguidance here), and the parsers of forced outputs (server/generation/tool_parsers/forced.py).
"""

from __future__ import annotations

import json

import pydantic
import pytest

from server.api.completions.params import parse_chat_request
from server.api.completions.tool_fields import parse_tool_choice
from server.generation.chat_messages import check_messages
from server.generation.structured_output import grammar_text
from server.generation.tool_calling import ToolChoiceMode
from server.generation.tool_parsers.forced import NamedToolParser, RequiredToolParser
from server.http.errors import ApiError

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.",
                                            "parameters": {"type": "object", "required": ["city"],
                                                           "properties": {"city": {"type": "string"}}}}}
TIME = {"type": "function", "function": {"name": "get_time"}}
MESSAGES = [{"role": "user", "content": "Weather?"}]


@pytest.mark.parametrize("body, mode, name", [
    ({"tools": [WEATHER]}, ToolChoiceMode.AUTO, None),
    ({"tools": [WEATHER], "tool_choice": "none"}, ToolChoiceMode.NONE, None),
    ({"tools": [WEATHER, TIME], "tool_choice": "required"}, ToolChoiceMode.REQUIRED, None),
    ({"tools": [WEATHER, TIME], "tool_choice": {"type": "function", "function": {"name": "get_time"}}},
     ToolChoiceMode.FUNCTION, "get_time"),
])
def test_tool_choice_reads_with_openais_defaults(body, mode, name):
    choice = parse_tool_choice(body)
    assert choice is not None and (choice.mode, choice.function_name) == (mode, name)
    assert choice.tools == body["tools"]
    assert parse_tool_choice({}) is None and parse_tool_choice({"tool_choice": "none"}) is None


@pytest.mark.parametrize("body, param", [
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "get_time"}}}, "tool_choice"),
    ({"tools": {"get_weather": WEATHER}}, "tools"),
    ({"tools": [{"type": "retrieval"}]}, "tools[0]"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools[0].function.name"),
    ({"tools": [WEATHER, WEATHER]}, "tools[1].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": "{}"}}]}, "tools[0].function.parameters"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": None}}]}, "tools[0].function.parameters"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}]},
     "tools[0].function.parameters"),
    ({"tools": [{"type": "function", "function": {"name": "f", "returns": {}}}]}, "tools[0].function.returns"),
    ({"tools": [WEATHER], "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
])
def test_malformed_tools_or_tool_choice_are_a_400_naming_the_field(body, param):
    with pytest.raises(ApiError) as info:
        parse_tool_choice(body)
    assert (info.value.status, info.value.param) == (400, param)


def test_a_forced_choice_is_the_requests_grammar_and_excludes_another_constraint():
    request = parse_chat_request({"messages": MESSAGES, "tools": [WEATHER], "tool_choice": "required"})
    assert request.grammar is not None and request.grammar.param == "tools"
    assert parse_chat_request({"messages": MESSAGES, "tools": [WEATHER]}).grammar is None  # auto: free text
    auto_with_regex = parse_chat_request({"messages": MESSAGES, "tools": [WEATHER], "guided_regex": "x"})
    assert auto_with_regex.grammar is not None and auto_with_regex.grammar.param == "guided_regex"
    with pytest.raises(ApiError) as info:
        parse_chat_request({"messages": MESSAGES, "tools": [WEATHER], "tool_choice": "required",
                            "response_format": {"type": "json_object"}})
    assert info.value.param == "response_format"


def test_the_required_grammar_takes_calls_of_the_tools_only(accepts):
    choice = parse_tool_choice({"tools": [WEATHER, TIME], "tool_choice": "required"})
    grammar = grammar_text(choice.grammar_spec())
    assert accepts(grammar, '[{"name":"get_weather","parameters":{"city":"Oslo"}}]')
    assert accepts(grammar, '[{"name":"get_time","parameters":{}},{"name":"get_weather","parameters":{"city":"A"}}]')
    assert not accepts(grammar, "[]")
    assert not accepts(grammar, '[{"name":"get_weather","parameters":{}}]')  # city is required
    assert not accepts(grammar, '[{"name":"launch","parameters":{}}]')
    single = parse_tool_choice({"tools": [WEATHER, TIME], "tool_choice": "required", "parallel_tool_calls": False})
    assert not accepts(grammar_text(single.grammar_spec()),
                       '[{"name":"get_time","parameters":{}},{"name":"get_time","parameters":{}}]')


def test_required_keeps_each_tools_own_definitions_and_references(accepts):
    class Address(pydantic.BaseModel):
        city: str

    class Trip(pydantic.BaseModel):  # Pydantic writes nested models as $defs and $ref
        start: Address
        end: Address | None = None

    tools = [{"type": "function", "function": {"name": "plan", "parameters": Trip.model_json_schema()}}, WEATHER]
    grammar = grammar_text(parse_tool_choice({"tools": tools, "tool_choice": "required"}).grammar_spec())
    assert accepts(grammar, '[{"name":"plan","parameters":{"start":{"city":"Oslo"},"end":null}}]')
    assert not accepts(grammar, '[{"name":"plan","parameters":{"start":{"town":"Oslo"}}}]')


def test_a_deeply_nested_arguments_string_is_a_400_not_a_crash():
    call = {"id": "c", "type": "function", "function": {"name": "get_weather", "arguments": "[" * 100000}}
    with pytest.raises(ApiError) as info:
        check_messages([{"role": "assistant", "content": None, "tool_calls": [call]}])
    assert (info.value.status, info.value.param) == (400, "messages[0].tool_calls[0]")


def test_a_named_choice_grammar_is_the_functions_parameters(accepts):
    choice = parse_tool_choice({"tools": [WEATHER], "tool_choice": {"type": "function",
                                                                  "function": {"name": "get_weather"}}})
    grammar = grammar_text(choice.grammar_spec())
    assert accepts(grammar, '{"city":"Lima"}') and not accepts(grammar, '{"town":"Lima"}')


def test_a_required_output_streams_each_call_as_its_object_closes():
    text = '[{"name":"get_weather","parameters":{"city":"Oslo"}},{"name":"get_time","parameters":{}}]'
    streamed = RequiredToolParser()
    deltas = [streamed.feed(char) for char in text] + [streamed.finish()]
    assert all(delta.content is None for delta in deltas)
    first_call_ends = text.index("}},") + 1  # the character that closes the first object
    assert [i for i, delta in enumerate(deltas) if delta.tool_calls] == [first_call_ends, len(text) - 2]
    whole = RequiredToolParser()
    whole.feed(text)
    whole.finish()
    assert [(c.name, json.loads(c.arguments)) for c in whole.tool_calls] == \
        [("get_weather", {"city": "Oslo"}), ("get_time", {})]
    cut = RequiredToolParser()
    cut.feed('[{"name":"get_weather","param')
    assert cut.finish().content == '[{"name":"get_weather","param' and not cut.tool_calls


def test_a_named_output_streams_its_name_first_then_its_arguments_as_they_come():
    parser = NamedToolParser("get_weather")
    first, second = parser.feed('{"city":'), parser.feed('"Rome"}')
    assert first.tool_calls[0] == {"index": 0, "id": parser.call.id, "type": "function",
                                   "function": {"name": "get_weather"}}
    assert first.tool_calls[1:] + second.tool_calls == [{"index": 0, "function": {"arguments": '{"city":'}},
                                                         {"index": 0, "function": {"arguments": '"Rome"}'}}]
    assert parser.finish().tool_calls == [] and parser.call.arguments == '{"city":"Rome"}'
