"""Function tools on the Responses API as agent frameworks meet them: `python -m server` on a Qwen2-shaped random
checkpoint with a Qwen2.5-shaped tool template (tests/helpers/tool_chat_template.py), spoken to by the openai SDK's
`client.responses.create`, streamed and not.

The random model never writes a call by itself: "required" and named choices are the grammar's doing. For "auto",
/v1/responses has no guided_regex to force hermes' `<tool_call>` tags, so this server reads "auto" outputs with the
llama3_json parser, whose calls are bare JSON objects that a text.format json_schema can force; the hermes format's
items are tested without a server (test_responses_tools.py).
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
TIME_PARAMETERS = {"type": "object", "additionalProperties": False, "properties": {}}
TOOLS = [{"type": "function", "name": "get_weather", "description": "The weather in a city.",
          "parameters": WEATHER_PARAMETERS, "strict": True},
         {"type": "function", "name": "get_time", "description": "The time now.", "parameters": TIME_PARAMETERS,
          "strict": True}]
PARAMETERS = {tool["name"]: tool["parameters"] for tool in TOOLS}
QUESTION = "What is the weather in Paris?"
MAX_OUTPUT_TOKENS = 200
CALL_ITEM_EVENTS = ["response.output_item.added", "response.function_call_arguments.delta",
                    "response.function_call_arguments.done", "response.output_item.done"]


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> RunningServer:
    running = start_tool_server(tmp_path_factory, MODEL, "llama3_json")
    yield running
    stop_server(running)


def create(server: RunningServer, seed: int | None = None, **fields):
    """seed: this server's extra field, which the SDK sends in the body."""
    extra = {"extra_body": {"seed": seed}} if seed is not None else {}
    return server.client().responses.create(**{"model": MODEL, "input": QUESTION,
                                               "max_output_tokens": MAX_OUTPUT_TOKENS, **extra, **fields})


def streamed(server: RunningServer, **fields):
    """The stream's events, checked for order and numbering, and its final response."""
    events = list(create(server, stream=True, **fields))
    assert [event.sequence_number for event in events] == list(range(len(events)))
    assert [event.type for event in events[:2]] == ["response.created", "response.in_progress"]
    final = events[-1].response
    assert events[-1].type == f"response.{final.status}"
    item_events = events[2:-1]
    for item in final.output:  # each item's events in a run, in output order, before the next item's
        run = [event for event in item_events if getattr(event, "output_index", None) == item_events[0].output_index]
        assert item_events[:len(run)] == run and run[-1].item.model_dump() == item.model_dump()
        if item.type == "function_call":
            assert [run[0].type, *sorted({event.type for event in run[1:-2]}), *(e.type for e in run[-2:])] == \
                CALL_ITEM_EVENTS
            assert "".join(event.delta for event in run[1:-2]) == run[-2].arguments == item.arguments
            assert run[0].item.arguments == "" and run[0].item.status == "in_progress"
        item_events = item_events[len(run):]
    assert item_events == []
    return events, final


def calls(response) -> list[tuple[str, str]]:
    return [(item.name, item.arguments) for item in response.output if item.type == "function_call"]


def assert_valid_calls(response) -> None:
    assert response.output and all(item.type == "function_call" for item in response.output)
    for item in response.output:
        assert item.id.startswith("fc_") and item.call_id.startswith("call_") and item.status == "completed"
        assert item.name in PARAMETERS
        jsonschema.validate(json.loads(item.arguments), PARAMETERS[item.name])


def test_tools_reach_the_template_and_the_response_echoes_them(server):
    plain = create(server, max_output_tokens=1)
    with_tools = create(server, max_output_tokens=1, tools=TOOLS, tool_choice="none")
    assert with_tools.usage.input_tokens > plain.usage.input_tokens + 50
    assert [tool.model_dump(exclude_none=True) for tool in with_tools.tools] == TOOLS
    assert (with_tools.tool_choice, with_tools.parallel_tool_calls) == ("none", True)
    assert [item.type for item in with_tools.output] == ["message"]


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_required_gives_valid_function_calls_streamed_and_not(server, seed):
    whole = create(server, tools=TOOLS, tool_choice="required", temperature=1.0, seed=seed)
    assert whole.status == "completed" and whole.tool_choice == "required"
    assert_valid_calls(whole)
    _, final = streamed(server, tools=TOOLS, tool_choice="required", temperature=1.0, seed=seed)
    assert calls(final) == calls(whole)
    assert server.client().responses.retrieve(final.id).model_dump() == final.model_dump()


def test_parallel_tool_calls_false_gives_one_call_and_is_echoed(server):
    for seed in range(4):
        response = create(server, tools=TOOLS, tool_choice="required", parallel_tool_calls=False, temperature=1.0,
                          seed=seed)
        assert len(response.output) == 1 and response.parallel_tool_calls is False


def test_a_named_function_is_called_with_valid_arguments_streamed_and_not(server):
    named = {"type": "function", "name": "get_weather"}
    whole = create(server, tools=TOOLS, tool_choice=named, temperature=1.0, seed=4)
    assert_valid_calls(whole)
    assert [name for name, _ in calls(whole)] == ["get_weather"]
    assert whole.tool_choice.model_dump() == named
    events, final = streamed(server, tools=TOOLS, tool_choice=named, temperature=1.0, seed=4)
    assert calls(final) == calls(whole)
    num_deltas = sum(event.type == "response.function_call_arguments.delta" for event in events)
    assert num_deltas > 1  # the arguments stream as they are generated


def test_a_function_call_output_continues_the_conversation(server):
    first = create(server, tools=TOOLS, tool_choice={"type": "function", "name": "get_weather"}, temperature=1.0,
                   seed=5)
    [call] = first.output
    answer = create(server, previous_response_id=first.id, tools=TOOLS, tool_choice="none", max_output_tokens=4,
                    input=[{"type": "function_call_output", "call_id": call.call_id, "output": "18 degrees, sunny"}])
    assert answer.status in ("completed", "incomplete") and [item.type for item in answer.output] == ["message"]
    chat = server.client().chat.completions.create(  # the same conversation, as chat messages: the same prompt
        model=MODEL, max_tokens=1, tools=[{"type": "function", "function": {k: v for k, v in tool.items() if k != "type"}}
                                          for tool in TOOLS], tool_choice="none",
        messages=[{"role": "user", "content": QUESTION},
                  {"role": "assistant", "content": None, "tool_calls": [
                      {"id": call.call_id, "type": "function",
                       "function": {"name": call.name, "arguments": call.arguments}}]},
                  {"role": "tool", "tool_call_id": call.call_id, "content": "18 degrees, sunny"}])
    assert answer.usage.input_tokens == chat.usage.prompt_tokens > first.usage.input_tokens + 20
    again = create(server, previous_response_id=answer.id, input="And tomorrow?", tools=TOOLS, tool_choice="none",
                   max_output_tokens=1)  # the stored turn keeps the call and its output for the turn after
    assert again.usage.input_tokens > answer.usage.input_tokens + answer.usage.output_tokens


def test_auto_turns_a_call_in_the_text_into_a_function_call_item(server):
    call_schema = {"type": "object", "additionalProperties": False, "required": ["name", "parameters"],
                   "properties": {"name": {"const": "get_weather"}, "parameters": WEATHER_PARAMETERS}}
    text = {"format": {"type": "json_schema", "name": "call", "schema": call_schema, "strict": True}}
    whole = create(server, tools=TOOLS, text=text, temperature=1.0, seed=6)
    assert whole.tool_choice == "auto"
    assert_valid_calls(whole)
    _, final = streamed(server, tools=TOOLS, text=text, temperature=1.0, seed=6)
    assert calls(final) == calls(whole)
    plain = create(server, tools=TOOLS, max_output_tokens=8, temperature=0)  # no call in the text: a message
    assert [item.type for item in plain.output] == ["message"] and plain.status == "incomplete"


@pytest.mark.parametrize("fields, param", [
    ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice"),
    ({"tools": [{"type": "function", "name": "bad name"}]}, "tools[0].name"),
    ({"tools": TOOLS, "tool_choice": "required", "text": {"format": {"type": "json_object"}}}, "text.format"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "get_time", "arguments": "{"}]}, "input[0].arguments"),
])
def test_bad_tool_requests_are_400s_naming_the_field(server, fields, param):
    with pytest.raises(openai.BadRequestError) as info:
        create(server, **fields)
    assert info.value.body["param"] == param
