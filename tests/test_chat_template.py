"""Chat templates: messages checked and rendered by real jinja2 templates.

Renders are checked against the text they must give and, where transformers
renders the same thing (tools, tool calls, continue_final_message), against
transformers' own render_jinja_template: the reference these templates are
written for.
"""

from __future__ import annotations

import json

import pytest
from transformers.utils.chat_template_utils import render_jinja_template

from server.generation.chat_messages import check_messages
from server.generation.chat_template import ChatTemplate, load_chat_template, require_template
from server.http.errors import ApiError

from helpers.tiny_tokenizer import CHAT_TEMPLATE
from helpers.tool_chat_template import TOOL_CHAT_TEMPLATE

MODEL = "tiny"
WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather <now> & here",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TOOL_CONVERSATION = [
    {"role": "user", "content": "Weather in Paris and Rome?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
        {"id": "call_2", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "21 C"},
    {"role": "tool", "tool_call_id": "call_2", "content": "25 C"},
    {"role": "assistant", "content": "Paris 21 C, Rome 25 C."},
    {"role": "user", "content": "Thanks"},
]


def transformers_render(source: str, messages: list[dict], **kwargs) -> str:
    [rendered], _ = render_jinja_template(conversations=[messages], chat_template=source, **kwargs)
    return rendered


# ---------------------------------------------------------------------------------------------- messages

def test_string_and_parts_content_render():
    template = ChatTemplate(CHAT_TEMPLATE)
    messages = check_messages([{"role": "system", "content": "Be brief."},
                               {"role": "user", "content": [{"type": "text", "text": "Hi"},
                                                            {"type": "text", "text": "there"}]}])
    text = template.render(messages, bos_token="<s>", eos_token="</s>")
    assert text == "<s><|system|>\nBe brief.</s>\n<|user|>\nHi\nthere</s>\n<|assistant|>\n"
    assert not template.render(messages, add_generation_prompt=False).endswith("<|assistant|>\n")


@pytest.mark.parametrize("messages, param", [
    ([], "messages"), ("hi", "messages"), ([{"content": "x"}], "messages[0].role"),
    ([{"role": "user", "content": 3}], "messages[0].content"),
    ([{"role": "user", "content": [{"type": "image_url"}]}], "messages[0].content[0]"),
    ([{"role": "tool", "content": None, "tool_call_id": "c"}], "messages[0].content"),
    ([{"role": "tool", "content": "x", "tool_call_id": 7}], "messages[0].tool_call_id"),
    ([{"role": "user", "content": "x", "tool_calls": []}], "messages[0].tool_calls"),
    ([{"role": "assistant", "tool_calls": {"id": "c"}}], "messages[0].tool_calls"),
])
def test_messages_are_checked(messages, param):
    with pytest.raises(ApiError) as info:
        check_messages(messages)
    assert (info.value.status, info.value.param) == (400, param)


GOOD_CALL = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}


@pytest.mark.parametrize("bad", [
    "call", {**GOOD_CALL, "id": None}, {**GOOD_CALL, "type": "retrieval"}, {**GOOD_CALL, "function": "f"},
    {**GOOD_CALL, "function": {"arguments": "{}"}}, {**GOOD_CALL, "function": {"name": "f", "arguments": "{oops"}},
    {**GOOD_CALL, "function": {"name": "f", "arguments": 5}},
])
def test_a_malformed_tool_call_is_a_400_naming_it(bad):
    with pytest.raises(ApiError) as info:
        check_messages([{"role": "user", "content": "x"},
                        {"role": "assistant", "content": None, "tool_calls": [GOOD_CALL, bad]}])
    assert (info.value.status, info.value.param) == (400, "messages[1].tool_calls[1]")
    assert "messages[1].tool_calls[1]" in info.value.message


def test_tool_call_arguments_reach_the_template_parsed_and_nulls_absent():
    [assistant] = check_messages([{"role": "assistant", "content": None, "name": None, "tool_calls": [
        GOOD_CALL, {**GOOD_CALL, "function": {"name": "g", "arguments": '{"a": [1, "<b>"]}'}},
        {**GOOD_CALL, "function": {"name": "h", "arguments": None}},
        {**GOOD_CALL, "function": {"name": "i", "arguments": {"already": "parsed"}}}]}])
    assert [call["function"]["arguments"] for call in assistant["tool_calls"]] == [
        {}, {"a": [1, "<b>"]}, {}, {"already": "parsed"}]
    assert assistant["content"] == "" and "name" not in assistant
    assert "tool_calls" not in check_messages([{"role": "assistant", "content": "x", "tool_calls": []}])[0]


# ---------------------------------------------------------------------------------------------- tools

def test_tools_and_a_conversation_with_tool_calls_render():
    template = ChatTemplate(TOOL_CHAT_TEMPLATE)
    messages = check_messages(TOOL_CONVERSATION)
    text = template.render(messages, tools=[WEATHER_TOOL])
    assert f"<tools>\n{json.dumps(WEATHER_TOOL)}\n</tools>" in text  # tojson as json.dumps: no HTML escapes
    assert text.endswith(
        "<|im_start|>user\nWeather in Paris and Rome?<|im_end|>\n"
        "<|im_start|>assistant\n"
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\n<tool_response>\n21 C\n</tool_response>\n<tool_response>\n25 C\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\nParis 21 C, Rome 25 C.<|im_end|>\n"
        "<|im_start|>user\nThanks<|im_end|>\n"
        "<|im_start|>assistant\n")
    assert text == transformers_render(TOOL_CHAT_TEMPLATE, messages, tools=[WEATHER_TOOL], add_generation_prompt=True)


def test_without_tools_the_template_sees_none():
    template = ChatTemplate("{{ tools is none }}|{{ messages | length }}")
    assert template.render(check_messages([{"role": "user", "content": "x"}])) == "True|1"
    without = ChatTemplate(TOOL_CHAT_TEMPLATE).render(check_messages(TOOL_CONVERSATION))
    assert "<tools>" not in without and without.startswith("<|im_start|>system\nYou are a helpful assistant.<|im_end|>")


# ---------------------------------------------------------------------------------------------- template variables

def test_template_kwargs_become_variables_and_may_replace_special_tokens():
    template = ChatTemplate("{{ bos_token }}{% if enable_thinking %}<think>{% endif %}{{ messages[0].content }}"
                            "{{ extra | tojson }}")
    messages = check_messages([{"role": "user", "content": "x"}])
    assert template.render(messages, bos_token="<s>", template_kwargs={"extra": None}) == "<s>xnull"
    assert template.render(messages, bos_token="<s>", template_kwargs={
        "enable_thinking": True, "bos_token": "[B]", "extra": {"k": "<&>"}}) == '[B]<think>x{"k": "<&>"}'
    with pytest.raises(ApiError) as info:  # what a template raises on a request's values is that request's 400
        ChatTemplate("{{ 1 / n }}").render(messages, template_kwargs={"n": 0})
    assert (info.value.status, info.value.param) == (400, "messages") and "ZeroDivisionError" in info.value.message


# ---------------------------------------------------------------------------------------------- continue_final_message

PREFILL = [{"role": "user", "content": "Tell me a story"}, {"role": "assistant", "content": "Once upon a"}]


@pytest.mark.parametrize("source", [CHAT_TEMPLATE, TOOL_CHAT_TEMPLATE,
                                    "{% for m in messages %}[{{ m.role }}] {{ m.content | trim }} [end]\n{% endfor %}"])
@pytest.mark.parametrize("final", ["Once upon a", "Once upon a ", ""])
def test_continue_final_message_cuts_where_transformers_does(source, final):
    messages = check_messages([PREFILL[0], {"role": "assistant", "content": final}])
    text = ChatTemplate(source).render(messages, add_generation_prompt=False, continue_final_message=True,
                                       bos_token="<s>", eos_token="</s>")
    assert text == transformers_render(source, messages, continue_final_message=True, bos_token="<s>",
                                       eos_token="</s>")
    closed = ChatTemplate(source).render(messages, add_generation_prompt=False, bos_token="<s>", eos_token="</s>")
    assert closed.startswith(text) and len(closed) > len(text)
    assert text.endswith(final) or text.endswith(final.rstrip())  # a template that trims may lose the trailing space


def test_continue_final_message_needs_an_assistant_message_the_template_keeps():
    template = ChatTemplate(CHAT_TEMPLATE)
    with pytest.raises(ApiError) as info:
        template.render(check_messages(PREFILL[:1]), add_generation_prompt=False, continue_final_message=True)
    assert (info.value.status, info.value.param) == (400, "continue_final_message")
    assert "assistant" in info.value.message and "'user'" in info.value.message
    dropping = ChatTemplate("{% for m in messages %}{% if m.role == 'user' %}{{ m.content }}{% endif %}{% endfor %}")
    with pytest.raises(ApiError) as info:
        dropping.render(check_messages(PREFILL), add_generation_prompt=False, continue_final_message=True)
    assert (info.value.status, info.value.param) == (400, "continue_final_message")


# ---------------------------------------------------------------------------------------------- finding the template

def test_template_sources_and_missing_template(tmp_path):
    assert load_chat_template(tmp_path, None) is None
    with pytest.raises(ApiError) as info:
        require_template(None, MODEL)
    assert info.value.status == 400 and "chat template" in info.value.message
    assert load_chat_template(tmp_path, [{"name": "default", "template": "A"}]).source == "A"
    (tmp_path / "chat_template.jinja").write_text("B")
    assert load_chat_template(tmp_path, "A").source == "B"
    (tmp_path / "override.jinja").write_text("C")
    assert load_chat_template(tmp_path, "A", tmp_path / "override.jinja").source == "C"
    with pytest.raises(ValueError, match="not valid jinja2"):
        ChatTemplate("{% for %}")
    with pytest.raises(ApiError) as info:
        ChatTemplate("{{ raise_exception('no system role') }}").render([])
    assert info.value.status == 400 and "no system role" in info.value.message
