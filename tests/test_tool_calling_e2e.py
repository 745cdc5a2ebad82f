"""Tool calling as agent frameworks meet it: `python -m server` on a Qwen2-shaped random checkpoint with a Qwen2.5-
shaped tool template (tests/helpers/tool_chat_template.py), started with --enable-auto-tool-choice
--tool-call-parser hermes, spoken to by the openai SDK, streamed and not.

The random model never writes a call by itself: "required" and named choices are the grammar's doing, and "auto"
is shown on a `<tool_call>` text forced by a regex, which the hermes parser must turn into tool_calls.
"""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from helpers.running_server import RunningServer, stop_server
from helpers.tool_chat_template import start_tool_server

MODEL = "tiny-qwen2"
WEATHER_PARAMETERS = {"type": "object", "additionalProperties": False, "required": ["city", "unit"],
                      "properties": {"city": {"type": "string", "maxLength": 12},
                                     "unit": {"enum": ["celsius", "fahrenheit"]}}}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.",
                                           "parameters": WEATHER_PARAMETERS}},
         {"type": "function", "function": {"name": "get_time", "description": "The time now.",
                                           "parameters": {"type": "object", "additionalProperties": False,
                                                          "properties": {}}}}]
PARAMETERS = {tool["function"]["name"]: tool["function"]["parameters"] for tool in TOOLS}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
MAX_TOKENS = 200


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> RunningServer:
    running = start_tool_server(tmp_path_factory, MODEL, "hermes")
    yield running
    stop_server(running)


def create(server: RunningServer, **fields):
    return server.client().chat.completions.create(**{"model": MODEL, "messages": MESSAGES, "max_tokens": MAX_TOKENS,
                                                      **fields})


def streamed_calls(server: RunningServer, **fields) -> tuple[list[dict], str | None, str]:
    """The tool calls a stream assembles from its deltas (by index), its finish reason and its content."""
    calls: dict[int, dict] = {}
    finish_reason, content = None, ""
    for chunk in create(server, stream=True, **fields):
        choice = chunk.choices[0]
        content += choice.delta.content or ""
        finish_reason = choice.finish_reason or finish_reason
        for delta in choice.delta.tool_calls or []:
            call = calls.setdefault(delta.index, {"id": delta.id, "name": "", "arguments": ""})
            assert delta.id in (None, call["id"]) and delta.type in (None, "function")
            call["name"] += delta.function.name or ""
            call["arguments"] += delta.function.arguments or ""
    return [calls[i] for i in sorted(calls)], finish_reason, content


def assert_valid_call(name: str, arguments: str) -> None:
    assert name in PARAMETERS
    jsonschema.validate(json.loads(arguments), PARAMETERS[name])


def test_tools_reach_the_template(server):
    plain = create(server, max_tokens=1)
    with_tools = create(server, max_tokens=1, tools=TOOLS, tool_choice="none")
    assert with_tools.usage.prompt_tokens > plain.usage.prompt_tokens + 50
    assert with_tools.choices[0].message.tool_calls is None


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_required_gives_valid_calls_streamed_and_not(server, seed):
    whole = create(server, tools=TOOLS, tool_choice="required", temperature=1.0, seed=seed)
    choice = whole.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None and choice.message.tool_calls
    for call in choice.message.tool_calls:
        assert call.type == "function" and call.id.startswith("chatcmpl-tool-")
        assert_valid_call(call.function.name, call.function.arguments)
    calls, finish_reason, content = streamed_calls(server, tools=TOOLS, tool_choice="required", temperature=1.0,
                                                   seed=seed)
    assert finish_reason == "tool_calls" and content == ""
    assert [(c["name"], c["arguments"]) for c in calls] == \
        [(c.function.name, c.function.arguments) for c in choice.message.tool_calls]


def test_parallel_tool_calls_false_gives_one_call(server):
    for seed in range(4):
        choice = create(server, tools=TOOLS, tool_choice="required", parallel_tool_calls=False, temperature=1.0,
                        seed=seed).choices[0]
        assert len(choice.message.tool_calls) == 1


def test_a_named_function_is_called_with_valid_arguments_streamed_and_not(server):
    named = {"type": "function", "function": {"name": "get_weather"}}
    choice = create(server, tools=TOOLS, tool_choice=named, temperature=1.0, seed=4).choices[0]
    [call] = choice.message.tool_calls
    assert call.function.name == "get_weather" and choice.finish_reason == "stop"
    assert_valid_call(call.function.name, call.function.arguments)
    calls, finish_reason, _ = streamed_calls(server, tools=TOOLS, tool_choice=named, temperature=1.0, seed=4)
    assert [(c["name"], c["arguments"]) for c in calls] == [("get_weather", call.function.arguments)]


def test_auto_turns_a_tool_call_text_into_tool_calls(server):
    forced = r'Let me check\.<tool_call>\n\{"name": "get_weather", "arguments": \{"city": "(Paris|Rome)", ' \
             r'"unit": "celsius"\}\}\n</tool_call>'
    extra = {"extra_body": {"guided_regex": forced}}
    choice = create(server, tools=TOOLS, temperature=1.0, seed=5, **extra).choices[0]
    [call] = choice.message.tool_calls
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Let me check."
    assert call.function.name == "get_weather" and json.loads(call.function.arguments)["unit"] == "celsius"
    calls, finish_reason, content = streamed_calls(server, tools=TOOLS, temperature=1.0, seed=5, **extra)
    assert (finish_reason, content) == ("tool_calls", "Let me check.")
    assert [(c["name"], c["arguments"]) for c in calls] == [("get_weather", call.function.arguments)]
    plain = create(server, tools=TOOLS, max_tokens=8, temperature=0).choices[0]  # no call in the text: content
    assert plain.message.tool_calls is None and plain.finish_reason == "length"


def test_parallel_tool_calls_false_under_auto_keeps_the_first_call_streamed_and_not(server):
    two_calls = r'<tool_call>\n\{"name": "get_weather", "arguments": \{"city": "Rome", "unit": "celsius"\}\}\n' \
                r'</tool_call>\n<tool_call>\n\{"name": "get_time", "arguments": \{\}\}\n</tool_call>'
    extra = {"extra_body": {"guided_regex": two_calls}}
    both = create(server, tools=TOOLS, temperature=0, **extra).choices[0]
    assert [call.function.name for call in both.message.tool_calls] == ["get_weather", "get_time"]
    first = create(server, tools=TOOLS, temperature=0, parallel_tool_calls=False, **extra).choices[0]
    [call] = first.message.tool_calls
    assert (call.function.name, call.function.arguments) == ("get_weather", both.message.tool_calls[0].function.arguments)
    assert first.finish_reason == "tool_calls" and first.message.content is None
    calls, finish_reason, content = streamed_calls(server, tools=TOOLS, temperature=0, parallel_tool_calls=False,
                                                   **extra)
    assert [(c["name"], c["arguments"]) for c in calls] == [("get_weather", call.function.arguments)]
    assert (finish_reason, content) == ("tool_calls", "")


def test_a_conversation_with_tool_calls_and_results_renders(server):
    call = {"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}
    messages = [*MESSAGES, {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "call_1", "content": "18 degrees, sunny"}]
    answer = create(server, messages=messages, tools=TOOLS, tool_choice="none", max_tokens=4)
    first_turn = create(server, tools=TOOLS, tool_choice="none", max_tokens=4)
    assert answer.usage.prompt_tokens > first_turn.usage.prompt_tokens + 20


def test_bad_tool_requests_are_400s_naming_the_field(server):
    for fields, param in [({"tool_choice": "required"}, "tool_choice"),
                          ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
                           "tool_choice"),
                          ({"tools": [{"type": "function", "function": {"name": "bad name"}}]},
                           "tools[0].function.name")]:
        with pytest.raises(openai.BadRequestError) as info:
            create(server, **fields)
        assert info.value.body["param"] == param
