"""Function tools on the Responses API without a server: the request's tools, tool_choice and parallel_tool_calls
(server/api/responses/tool_fields.py), function_call and function_call_output input items as chat messages
(input_items.py), and the output items and stream events a choice's text becomes (output_items.py), with each
kind of parser: forced choices' and the hermes format's.
"""

from __future__ import annotations

import json
import re

import pytest

from server.api.responses.format import ResponseFormat
from server.api.responses.input_items import input_messages
from server.api.responses.output_items import OutputItems
from server.api.responses.params import parse_responses_request
from server.generation.chat_messages import check_messages
from server.generation.tool_calling import ToolChoiceMode
from server.generation.tool_parsers.forced import NamedToolParser, RequiredToolParser
from server.generation.tool_parsers.hermes import HermesToolParser
from server.http.errors import ApiError
from shared.sampling_params import SamplingParams

WEATHER_PARAMETERS = {"type": "object", "required": ["city"], "properties": {"city": {"type": "string"}}}
WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city.",
           "parameters": WEATHER_PARAMETERS, "strict": True}
TIME = {"type": "function", "name": "get_time"}
CALL = {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Oslo"}'}
RESULT = {"type": "function_call_output", "call_id": "call_1", "output": "18 degrees"}


def request(**fields):
    return parse_responses_request({"input": "Weather?", **fields})


def test_flattened_tools_become_chats_shape_and_the_response_echoes_the_requests():
    parsed = request(tools=[WEATHER, TIME], tool_choice="required", parallel_tool_calls=False)
    choice = parsed.tool_choice
    assert choice is not None and choice.mode is ToolChoiceMode.REQUIRED and not choice.parallel_tool_calls
    assert choice.tools == [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a "
                                                              "city.", "parameters": WEATHER_PARAMETERS, "strict": True}},
                            {"type": "function", "function": {"name": "get_time"}}]
    assert parsed.grammar is not None and parsed.grammar.param == "tools"
    assert parsed.tool_fields == {"tools": [WEATHER, TIME], "tool_choice": "required", "parallel_tool_calls": False}


@pytest.mark.parametrize("fields, mode, name", [
    ({"tools": [WEATHER]}, ToolChoiceMode.AUTO, None),
    ({"tools": [WEATHER], "tool_choice": "none"}, ToolChoiceMode.NONE, None),
    ({"tools": [WEATHER, TIME], "tool_choice": {"type": "function", "name": "get_time"}}, ToolChoiceMode.FUNCTION,
     "get_time"),
])
def test_tool_choice_reads_with_openais_defaults(fields, mode, name):
    parsed = request(**fields)
    assert parsed.tool_choice is not None and (parsed.tool_choice.mode, parsed.tool_choice.function_name) == (mode, name)
    assert parsed.tool_fields["tool_choice"] == fields.get("tool_choice", "auto")
    assert (parsed.grammar is None) == (mode is not ToolChoiceMode.FUNCTION)
    plain = request(tools=[], tool_choice="auto")  # OpenAI's default, sent with no tools: no tool calling
    assert plain.tool_choice is None and plain.tool_fields == {"tools": [], "tool_choice": "auto", "parallel_tool_calls": True}
    assert request(tool_choice="none").tool_fields["tool_choice"] == "none"


@pytest.mark.parametrize("fields, param", [
    ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"tools": [WEATHER, {"type": "file_search", "vector_store_ids": ["vs_1"]}]}, "tools[1].type"),
    ({"tools": [{"type": "function", "function": {"name": "get_weather"}}]}, "tools[0].function"),  # chat's shape
    ({"tools": [{"type": "function", "name": "bad name"}]}, "tools[0].name"),
    ({"tools": [WEATHER, WEATHER]}, "tools[1].name"),
    ({"tools": [{**WEATHER, "parameters": "{}"}]}, "tools[0].parameters"),
    ({"tools": [{**WEATHER, "parameters": None}]}, "tools[0].parameters"),  # OpenAI's: an object schema, or none
    ({"tools": [{**WEATHER, "parameters": {"type": "string"}}]}, "tools[0].parameters"),
    ({"tools": [{**WEATHER, "strict": "yes"}]}, "tools[0].strict"),
    ({"tools": "get_weather"}, "tools"),
    ({"tools": ["get_weather"]}, "tools[0]"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "name": "get_time"}}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": {"type": "file_search"}}, "tool_choice"),
    ({"tools": [WEATHER], "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
    ({"tools": [WEATHER], "tool_choice": "required", "text": {"format": {"type": "json_object"}}}, "text.format"),
])
def test_bad_tools_or_tool_choice_are_a_400_naming_the_field(fields, param):
    with pytest.raises(ApiError) as info:
        request(**fields)
    assert (info.value.status, info.value.param) == (400, param)


def test_auto_may_be_combined_with_a_text_format():
    parsed = request(tools=[WEATHER], text={"format": {"type": "json_object"}})
    assert parsed.tool_choice is not None and parsed.tool_choice.mode is ToolChoiceMode.AUTO
    assert parsed.grammar is not None and parsed.grammar.param == "text.format"


def test_function_call_items_join_the_assistant_turn_and_outputs_are_tool_messages():
    second = {**CALL, "call_id": "call_2", "arguments": '{"city": "Rome"}'}
    messages = input_messages([{"role": "user", "content": "Weather?"},
                               {"type": "message", "role": "assistant", "content": [{"type": "output_text",
                                                                                      "text": "Checking."}]},
                               CALL, second, RESULT, {**RESULT, "call_id": "call_2", "output": "21 degrees"}])
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}
    assert messages[1] == {"role": "assistant", "content": "Checking.",
                           "tool_calls": [call, {**call, "id": "call_2",
                                                 "function": {**call["function"], "arguments": '{"city": "Rome"}'}}]}
    assert messages[2:] == [{"role": "tool", "tool_call_id": "call_1", "content": "18 degrees"},
                            {"role": "tool", "tool_call_id": "call_2", "content": "21 degrees"}]
    assert input_messages([CALL])[0] == {"role": "assistant", "content": None, "tool_calls": [call]}
    checked = check_messages(input_messages([CALL, RESULT]))  # as the chat template is handed them
    assert checked[0]["tool_calls"][0]["function"]["arguments"] == {"city": "Oslo"}


@pytest.mark.parametrize("item, param", [
    ({**CALL, "call_id": None}, "input[0].call_id"),
    ({**CALL, "name": 7}, "input[0].name"),
    ({**CALL, "arguments": {"city": "Oslo"}}, "input[0].arguments"),
    ({**CALL, "arguments": "{city"}, "input[0].arguments"),
    ({**RESULT, "output": None}, "input[0].output"),
    ({"type": "reasoning", "summary": []}, "input[0].type"),
    ({"type": "web_search_call", "id": "ws_1"}, "input[0].type"),
])
def test_bad_input_items_are_a_400_naming_the_field(item, param):
    with pytest.raises(ApiError) as info:
        input_messages([item])
    assert (info.value.status, info.value.param) == (400, param)


# ---------------------------------------------------------------------------------------------- output items


def response_format() -> ResponseFormat:
    return ResponseFormat("resp_" + "0" * 32, "m", SamplingParams(), text={"format": {"type": "text"}},
                          instructions=None, previous_response_id=None, max_output_tokens=None, store=True,
                          metadata={}, tool_fields={"tools": [], "tool_choice": "auto", "parallel_tool_calls": True})


def build(parser, pieces: list[str], status: str = "completed") -> tuple[list[dict], list[dict], OutputItems]:
    """The events of a stream of `pieces` and the output they build."""
    items = OutputItems(response_format(), parser)
    events = items.start()
    for piece in pieces:
        events += items.feed(piece)
    events += items.finish(status)
    return events, items.output, items


def without_ids(output: list[dict]) -> list[dict]:
    return [{key: value for key, value in item.items() if key not in ("id", "call_id")} for item in output]


def test_a_plain_output_is_one_message_opened_before_any_text():
    events, output, items = build(None, ["Hel", "lo"])
    assert [e["type"] for e in events] == [
        "response.output_item.added", "response.content_part.added", "response.output_text.delta",
        "response.output_text.delta", "response.output_text.done", "response.content_part.done",
        "response.output_item.done"]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    [message] = output
    assert message["type"] == "message" and message["content"][0]["text"] == "Hello" and message["status"] == "completed"
    assert items.assistant_message() == {"role": "assistant", "content": "Hello"}
    _, [empty], _ = build(None, [], "incomplete")
    assert empty["content"][0]["text"] == "" and empty["status"] == "incomplete"


def test_a_required_output_is_function_call_items_each_closed_before_the_next():
    text = '[{"name":"get_weather","parameters":{"city":"Oslo"}},{"name":"get_time","parameters":{}}]'
    events, output, items = build(RequiredToolParser(), list(text))
    assert without_ids(output) == [
        {"type": "function_call", "name": "get_weather", "arguments": '{"city": "Oslo"}', "status": "completed"},
        {"type": "function_call", "name": "get_time", "arguments": "{}", "status": "completed"}]
    assert all(re.fullmatch(r"fc_[0-9a-f]{32}", item["id"]) and re.fullmatch(r"call_[0-9a-f]{32}", item["call_id"])
               for item in output)
    per_item = ["response.output_item.added", "response.function_call_arguments.delta",
                "response.function_call_arguments.done", "response.output_item.done"]
    assert [e["type"] for e in events] == per_item * 2
    assert [e["output_index"] for e in events] == [0] * 4 + [1] * 4
    added, done = events[0]["item"], events[3]["item"]
    assert (added["arguments"], added["status"]) == ("", "in_progress") and done == output[0]
    assert events[2]["arguments"] == output[0]["arguments"] and events[2]["item_id"] == output[0]["id"]
    assert items.assistant_message() == {"role": "assistant", "content": "", "tool_calls": [
        {"id": item["call_id"], "type": "function", "function": {"name": item["name"], "arguments": item["arguments"]}}
        for item in output]}
    _, whole, _ = build(RequiredToolParser(), [text])
    assert without_ids(whole) == without_ids(output)


def test_a_named_functions_arguments_stream_as_they_come():
    events, [call], _ = build(NamedToolParser("get_weather"), ['{"city":', '"Rome"}'])
    deltas = [e["delta"] for e in events if e["type"] == "response.function_call_arguments.delta"]
    assert deltas == ['{"city":', '"Rome"}'] and json.loads(call["arguments"]) == {"city": "Rome"}
    _, [cut], items = build(NamedToolParser("get_weather"), ['{"city":'], "incomplete")
    assert cut["status"] == "incomplete" and cut["arguments"] == '{"city":'
    # the conversation keeps a call cut short as text: the next turn checks its history's calls
    assert items.assistant_message() == {"role": "assistant", "content": '{"city":'}


def test_auto_with_the_hermes_format_gives_a_message_then_a_call():
    text = 'Let me check.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    events, output, items = build(HermesToolParser(), [text[i:i + 5] for i in range(0, len(text), 5)])
    assert without_ids(output) == [
        {"type": "message", "role": "assistant", "status": "completed",
         "content": [{"type": "output_text", "text": "Let me check.", "annotations": [], "logprobs": []}]},
        {"type": "function_call", "name": "get_weather", "arguments": '{"city": "Paris"}', "status": "completed"}]
    types = [e["type"] for e in events]
    assert types.index("response.output_item.done") < types.index("response.function_call_arguments.delta")
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert items.assistant_message()["content"] == "Let me check."
    _, whole, _ = build(HermesToolParser(), [text])
    assert without_ids(whole) == without_ids(output)
    _, [plain], _ = build(HermesToolParser(), ["No tools ", "needed."])
    assert plain["type"] == "message" and plain["content"][0]["text"] == "No tools needed."
    _, [empty], _ = build(HermesToolParser(), [])
    assert empty["type"] == "message" and empty["content"][0]["text"] == ""
