"""The Responses API's function_call and function_call_output input items as the chat messages a template renders
(server/api/responses/input_items.py).
"""

from __future__ import annotations

import pytest

from server.api.responses.input_items import input_messages
from server.generation.chat_messages import check_messages
from server.http.errors import ApiError

CALL = {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Oslo"}'}
RESULT = {"type": "function_call_output", "call_id": "call_1", "output": "18 degrees"}


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
