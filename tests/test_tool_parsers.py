"""The tool-call parsers: each format's calls and content from a whole output, then the same output streamed
one character at a time and in seeded random pieces, which must give the same content and calls."""

import json
import random
import re

import pytest

from server.generation.tool_parsers import TOOL_PARSERS, ToolParser, get_tool_parser
from server.generation.tool_parsers.hermes import HermesToolParser
from server.generation.tool_parsers.llama3_json import Llama3JsonToolParser

WEATHER = {"city": "Zürich", "units": "°C", "note": "a } and a \" and \\ inside"}


def hermes_block(name, arguments, key="arguments"):
    return f"<tool_call>\n{json.dumps({'name': name, key: arguments})}\n</tool_call>"


def calls_of(extracted):
    return [(call.name, json.loads(call.arguments)) for call in extracted.tool_calls]


def stream(parser_cls: type[ToolParser], pieces):
    """What a client assembles from the deltas: the content, and each call's (id, name, arguments) by index."""
    parser = parser_cls()
    content, calls = "", []
    for delta in [parser.feed(piece) for piece in pieces] + [parser.finish()]:
        content += delta.content or ""
        for entry in delta.tool_calls:
            if "id" in entry:
                assert entry["index"] == len(calls) and entry["type"] == "function" and "arguments" not in entry["function"]
                calls.append([entry["id"], entry["function"]["name"], ""])
            else:
                assert set(entry) == {"index", "function"} and set(entry["function"]) == {"arguments"}
                calls[entry["index"]][2] += entry["function"]["arguments"]
    assert parser.num_tool_calls == len(calls)
    return content or None, [tuple(call) for call in calls]


def random_pieces(text, seed):
    rng = random.Random(seed)
    cuts = sorted(rng.sample(range(1, len(text)), k=min(len(text) - 1, rng.randint(1, 12))))
    return [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]


# Registry

def test_parsers_by_name():
    assert get_tool_parser("hermes") is HermesToolParser and get_tool_parser("llama3_json") is Llama3JsonToolParser
    assert set(TOOL_PARSERS) == {"hermes", "llama3_json"}


def test_an_unknown_name_lists_the_known_ones():
    with pytest.raises(ValueError, match=r"'mistral'.*hermes, llama3_json"):
        get_tool_parser("mistral")


# hermes, whole output

def test_hermes_text_then_a_call():
    extracted = HermesToolParser.extract("Let me check.\n" + hermes_block("get_weather", WEATHER))
    assert extracted.content == "Let me check.\n"
    assert calls_of(extracted) == [("get_weather", WEATHER)]
    call = extracted.tool_calls[0]
    assert re.fullmatch(r"chatcmpl-tool-[0-9a-f]{32}", call.id)
    assert call.arguments == json.dumps(WEATHER, ensure_ascii=False) and "Zürich" in call.arguments
    assert call.to_openai() == {"id": call.id, "type": "function",
                                "function": {"name": "get_weather", "arguments": call.arguments}}


def test_hermes_several_calls_and_no_whitespace_content():
    text = hermes_block("a", {"x": 1}) + "\n" + hermes_block("b", {}) + "\n"
    extracted = HermesToolParser.extract(text)
    assert extracted.content is None and calls_of(extracted) == [("a", {"x": 1}), ("b", {})]
    assert len({call.id for call in extracted.tool_calls}) == 2


def test_hermes_text_between_and_after_calls_stays_content():
    text = "First:\n" + hermes_block("a", {}) + "\nthen\n" + hermes_block("b", {}) + " done."
    extracted = HermesToolParser.extract(text)
    assert extracted.content == "First:\n\nthen\n done." and calls_of(extracted) == [("a", {}), ("b", {})]


@pytest.mark.parametrize("body", ['{"name": "a", "arguments": {"x": 1}', "not json", '{"arguments": {}}',
                                  '{"name": "", "arguments": {}}', '{"name": "a", "arguments": "{}"}',
                                  '{"name": "a"}', '{"name": "a", "arguments": {"x": NaN}}', "[1, 2]"])
def test_hermes_a_malformed_block_stays_content(body):
    text = f"<tool_call>{body}</tool_call> and " + hermes_block("b", {"y": 2})
    extracted = HermesToolParser.extract(text)
    assert extracted.content == f"<tool_call>{body}</tool_call> and " and calls_of(extracted) == [("b", {"y": 2})]


def test_hermes_a_block_the_output_ends_in():
    unclosed = hermes_block("a", {"x": [1]}).removesuffix("</tool_call>")
    assert calls_of(HermesToolParser.extract(unclosed)) == [("a", {"x": [1]})]
    extracted = HermesToolParser.extract('ok <tool_call>{"name": "a", "argu')
    assert extracted.content == 'ok <tool_call>{"name": "a", "argu' and extracted.tool_calls == []


@pytest.mark.parametrize("text", ["", "Plain text.", "  \n", "a < b, <tool, <tool_call"])
def test_hermes_text_without_calls_is_all_content(text):
    extracted = HermesToolParser.extract(text)
    assert extracted.content == (text or None) and extracted.tool_calls == []


# llama3_json, whole output

def test_llama_one_call_with_parameters():
    extracted = Llama3JsonToolParser.extract(json.dumps({"name": "get_weather", "parameters": WEATHER}))
    assert extracted.content is None and calls_of(extracted) == [("get_weather", WEATHER)]
    assert extracted.tool_calls[0].arguments == json.dumps(WEATHER, ensure_ascii=False)


def test_llama_several_calls_after_the_python_tag():
    text = ('<|python_tag|>{"name": "a", "arguments": {"q": "\u65e5\u672c"}}; {"name": "b", "parameters": {}};'
            '{"name": "c", "parameters": {"n": [1, {"m": null}]}}\n')
    extracted = Llama3JsonToolParser.extract(text)
    assert extracted.content is None
    assert calls_of(extracted) == [("a", {"q": "日本"}), ("b", {}), ("c", {"n": [1, {"m": None}]})]


@pytest.mark.parametrize("text", ["Sure, here it is.", '{"a": 1}', '{"name": "a", "parameters": {}, "arguments": {}}',
                                  '{"name": "a", "parameters": [1]}', '{"name": "a", "parameters": {"x": 1}',
                                  'x {"name": "a", "parameters": {}}', "<|python_tag|>print(1)", "  <|python_ta", ""])
def test_llama_output_that_is_not_a_call_is_all_content(text):
    extracted = Llama3JsonToolParser.extract(text)
    assert extracted.content == (text or None) and extracted.tool_calls == []


@pytest.mark.parametrize("rest", ['; {"name": "b", "parameters": {', " That is all.", '; {"bad": 1}', ";"])
def test_llama_what_follows_the_last_call_is_content(rest):
    extracted = Llama3JsonToolParser.extract('{"name": "a", "parameters": {}}' + rest)
    assert calls_of(extracted) == [("a", {})] and extracted.content == rest


# Streaming

HERMES_OUTPUTS = [
    "Let me check.\n" + hermes_block("get_weather", WEATHER),
    hermes_block("a", {"x": 1}) + "\n" + hermes_block("b", {"s": "</tool_call"}) + "\n",
    "First <tool_call>not json</tool_call> then " + hermes_block("c", {"k": "\u00e9\U0001f600"}) + " done.",
    "<tool_<tool_call>" + json.dumps({"name": "d", "arguments": {}}),
    "no calls at all, just < and <tool and </tool_call>",
    "ends inside <tool_call>{\"name\": ",
]
LLAMA_OUTPUTS = [
    json.dumps({"name": "get_weather", "parameters": WEATHER}),
    '  <|python_tag|> {"name": "a", "arguments": {"q": "\u65e5"}} ;\n{"name": "b", "parameters": {"s": "}{\\""}}\n',
    '{"name": "a", "parameters": {}}; {"name": "b", "parameters": {"x": 1}} and some prose',
    '{"name": "a", "parameters": {}}; {"name": "b", "parameters": ',
    '{"a": "not a call"}; {"name": "b", "parameters": {}}',
    "Hello <|python_tag|>, a plain answer.",
]
CASES = [(HermesToolParser, text) for text in HERMES_OUTPUTS] + [(Llama3JsonToolParser, text) for text in LLAMA_OUTPUTS]


def whole(parser_cls, text):
    extracted = parser_cls.extract(text)
    return extracted.content, [(call.name, call.arguments) for call in extracted.tool_calls]


def without_ids(streamed):
    content, calls = streamed
    return content, [(name, arguments) for _, name, arguments in calls]


@pytest.mark.parametrize("parser_cls, text", CASES)
def test_streamed_one_character_at_a_time_as_whole(parser_cls, text):
    assert without_ids(stream(parser_cls, list(text))) == whole(parser_cls, text)


@pytest.mark.parametrize("seed", range(20))
@pytest.mark.parametrize("parser_cls, text", CASES)
def test_streamed_in_random_pieces_as_whole(parser_cls, text, seed):
    assert without_ids(stream(parser_cls, random_pieces(text, seed))) == whole(parser_cls, text)


def test_the_cases_cover_calls_content_and_both_together():
    results = [whole(parser_cls, text) for parser_cls, text in CASES]
    assert any(content is None and calls for content, calls in results)
    assert any(content and calls for content, calls in results)
    assert any(content and not calls for content, calls in results)


def test_a_call_is_sent_once_its_block_closes_name_first():
    parser = HermesToolParser()
    block = hermes_block("a", {"x": 1})
    assert parser.feed("Hi " + block[:-1]).tool_calls == [] and parser.num_tool_calls == 0
    delta = parser.feed(block[-1])
    call = parser.tool_calls[0]
    assert delta.tool_calls == [{"index": 0, "id": call.id, "type": "function", "function": {"name": "a"}},
                                {"index": 0, "function": {"arguments": '{"x": 1}'}}]
    assert parser.num_tool_calls == 1


def test_llama_a_call_is_sent_once_its_object_closes():
    parser = Llama3JsonToolParser()
    assert parser.feed('{"name": "a", "parameters": {"x": "}"}').tool_calls == []
    assert [entry["index"] for entry in parser.feed("}").tool_calls] == [0, 0]


@pytest.mark.parametrize("tail", ["<", "<tool", "<tool_call"])
def test_hermes_a_possible_opening_tag_is_held_then_flushed_as_content(tail):
    parser = HermesToolParser()
    assert parser.feed("Answer: 42 " + tail).content == "Answer: 42 "
    assert parser.finish().content == tail and parser.num_tool_calls == 0


def test_llama_a_possible_python_tag_is_held_then_flushed_as_content():
    parser = Llama3JsonToolParser()
    assert parser.feed(" <|python").content is None
    assert parser.finish().content == " <|python"


def test_whitespace_is_held_until_content_follows():
    parser = HermesToolParser()
    assert parser.feed("\n").content is None
    assert parser.feed("\nHi").content == "\n\nHi"
    assert parser.feed("\n").content == "\n"


@pytest.mark.parametrize("parser_cls, text", [
    (HermesToolParser, '\n<tool_call>{"name": "a", "arguments": {}}</tool_call>\n'),
    (Llama3JsonToolParser, '\n{"name": "a", "parameters": {}}\n'),
])
def test_whitespace_around_calls_is_dropped_at_the_end(parser_cls, text):
    parser = parser_cls()
    assert parser.feed(text).content is None
    assert parser.finish().content is None and parser.num_tool_calls == 1


FRAGMENTS = ["<tool_call>", "</tool_call>", "<tool_", "</tool", "<|python_tag|>", "<|py", ";", " ", "\n", "{", "}", '"',
             "\\", "text", '{"name": "f", "arguments": {"a": "}"}}', '{"name": "g", "parameters": {"b": [1]}}', "é😀"]


@pytest.mark.parametrize("seed", range(200))
def test_random_outputs_stream_as_whole(seed):
    rng = random.Random(seed)
    text = "".join(rng.choice(FRAGMENTS) for _ in range(rng.randint(1, 12)))
    for parser_cls in (HermesToolParser, Llama3JsonToolParser):
        expected = whole(parser_cls, text)
        assert without_ids(stream(parser_cls, list(text))) == expected
        if len(text) > 1:
            assert without_ids(stream(parser_cls, random_pieces(text, seed))) == expected


@pytest.mark.parametrize("parser_cls, text", [
    (HermesToolParser, HERMES_OUTPUTS[1]),
    (HermesToolParser, "Both: " + hermes_block("a", {}) + " and " + hermes_block("b", {"x": 2}) + " done."),
    (Llama3JsonToolParser, LLAMA_OUTPUTS[1]), (Llama3JsonToolParser, LLAMA_OUTPUTS[2])])
def test_one_call_only_keeps_the_first_and_drops_the_others_text_and_all(parser_cls, text):
    content, calls = whole(parser_cls, text)
    parser = parser_cls()
    parser.max_tool_calls = 1
    extracted = parser.parse(text)
    assert len(calls) == 2 and [(call.name, call.arguments) for call in extracted.tool_calls] == calls[:1]
    assert extracted.content == content, "a dropped call becomes no content"
