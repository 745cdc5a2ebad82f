"""Chat templates: messages checked, rendered by real jinja2 templates, and served end to end.

Renders are checked against the text they must give and, where transformers
renders the same thing (tools, tool calls, continue_final_message), against
transformers' own render_jinja_template: the reference these templates are
written for. The end-to-end tests run `python -m server` with an inline
--chat-template and speak to it with the openai SDK; the prompt a request
renders is read back as usage.prompt_tokens and compared with the token
count of the text it must render to.
"""

from __future__ import annotations

import json

import openai
import pytest
from transformers.utils.chat_template_utils import render_jinja_template

from server.generation.chat_messages import check_messages
from server.generation.chat_template import ChatTemplate, chat_template_source, load_chat_template, require_template
from server.generation.tokenizer import Tokenizer
from server.http.errors import ApiError

from helpers.running_server import RunningServer, start_server, stop_server
from helpers.tiny_tokenizer import CHAT_TEMPLATE, make_served_checkpoint
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
    assert load_chat_template(tmp_path, "A", "C").source == "C"
    with pytest.raises(ValueError, match="not valid jinja2"):
        ChatTemplate("{% for %}")
    with pytest.raises(ApiError) as info:
        ChatTemplate("{{ raise_exception('no system role') }}").render([])
    assert info.value.status == 400 and "no system role" in info.value.message


def test_chat_template_option_is_a_file_or_the_template_itself(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "t.jinja").write_text("{{ messages }} from a file")
    assert chat_template_source("t.jinja") == "{{ messages }} from a file"
    assert chat_template_source(str(tmp_path / "t.jinja")) == "{{ messages }} from a file"
    assert chat_template_source("{% for m in messages %}{{ m.content }}{% endfor %}").startswith("{% for")
    assert chat_template_source("{{ messages[0].content }}") == "{{ messages[0].content }}"
    long_inline = "{% for m in messages %}" + "x" * 300 + "{% endfor %}"  # no possible file name
    assert chat_template_source(long_inline) == long_inline
    with pytest.raises(ValueError, match="'missing.jinja' does not exist"):
        chat_template_source("missing.jinja")
    with pytest.raises(ValueError, match="cannot be read"):
        chat_template_source(str(tmp_path))


def test_a_missing_chat_template_file_stops_the_server_at_start_up(tmp_path):
    from server.__main__ import main

    with pytest.raises(SystemExit) as info:
        main(["--chat-template", str(tmp_path / "missing.jinja")])
    assert info.value.code == 2


# ---------------------------------------------------------------------------------------------- end to end

# Served inline (--chat-template TEXT): the checkpoint's template, plus a variable a request may set.
SERVED_TEMPLATE = "{% if story_mode %}Story time.\n{% endif %}" + CHAT_TEMPLATE


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("chat-template")
    checkpoint = make_served_checkpoint(tmp)
    server = start_server(tmp, checkpoint, "--served-model-name", MODEL, "--device", "cpu", "--dtype", "float32",
                          "--num-kv-blocks", "256", "--standby-workers", "0", "--chat-template", SERVED_TEMPLATE,
                          "--trust-request-chat-template")
    yield server, Tokenizer.from_dir(checkpoint)
    stop_server(server)


def prompt_tokens(server: RunningServer, messages: list[dict], **extra_body) -> int:
    result = server.client().chat.completions.create(model=MODEL, messages=messages, max_tokens=1,
                                                     extra_body=extra_body or None)
    return result.usage.prompt_tokens


def num_tokens(tokenizer: Tokenizer, text: str) -> int:
    return len(tokenizer.encode(text, add_special_tokens=False))


def test_continue_final_message_and_template_kwargs_change_the_prompt(served):
    server, tokenizer = served
    assert prompt_tokens(server, PREFILL[:1]) == num_tokens(tokenizer, "<s><|user|>\nTell me a story</s>\n<|assistant|>\n")
    continued = prompt_tokens(server, PREFILL, add_generation_prompt=False, continue_final_message=True)
    assert continued == num_tokens(tokenizer, "<s><|user|>\nTell me a story</s>\n<|assistant|>\nOnce upon a")
    closed = prompt_tokens(server, PREFILL, add_generation_prompt=False)
    assert closed == num_tokens(tokenizer, "<s><|user|>\nTell me a story</s>\n<|assistant|>\nOnce upon a</s>\n")
    assert closed > continued
    story = prompt_tokens(server, PREFILL[:1], chat_template_kwargs={"story_mode": True})
    assert story == num_tokens(tokenizer, "Story time.\n<s><|user|>\nTell me a story</s>\n<|assistant|>\n")
    own = prompt_tokens(server, PREFILL[:1], chat_template="{{ messages[0].content }}")
    assert own == num_tokens(tokenizer, "Tell me a story")


def test_chat_template_fields_are_refused_with_the_field_named(served):
    server, _ = served
    client = server.client()
    for extra_body, param in [({"add_generation_prompt": True, "continue_final_message": True}, "continue_final_message"),
                              ({"continue_final_message": True}, "continue_final_message"),
                              ({"chat_template_kwargs": ["story_mode"]}, "chat_template_kwargs"),
                              ({"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs.messages"),
                              ({"chat_template": "{% for %}"}, "chat_template")]:
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(model=MODEL, messages=PREFILL, max_tokens=1, extra_body=extra_body)
        assert info.value.body["param"] == param, (extra_body, info.value.body)
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=PREFILL[:1], max_tokens=1,
                                       extra_body={"add_generation_prompt": False, "continue_final_message": True})
    assert info.value.body["param"] == "continue_final_message" and "assistant" in info.value.body["message"]
