"""Structured output's request fields (server/api/structured_fields.py) and their compilation
(server/generation/structured_output.py), through the real parsers and llguidance on a real tokenizer.

Every way a client can ask for a constraint reads into the same GrammarSpec; two at once, a malformed one, or one
llguidance cannot compile is a 400 naming the field; a pathological schema is refused within a bounded time; the
compiled grammar is cached by the constraint's text.
"""

from __future__ import annotations

import asyncio
import time

import llguidance
import pytest

from server.api.completions.params import parse_chat_request, parse_completion_request
from server.api.responses.params import parse_responses_request
from server.api.structured_fields import ANY_WHITESPACE, grammar_spec
from server.generation.structured_output import GrammarCompiler, GrammarKind, GrammarSpec
from server.generation.tokenizer import Tokenizer
from server.http.errors import ApiError

from helpers.tiny_tokenizer import write_tokenizer

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
CHAT = {"messages": [{"role": "user", "content": "hi"}]}


@pytest.fixture(scope="module")
def compiler(tmp_path_factory) -> GrammarCompiler:
    path = tmp_path_factory.mktemp("tokenizer")
    write_tokenizer(path)
    return GrammarCompiler(Tokenizer.from_dir(path))


def compile_spec(compiler: GrammarCompiler, spec: GrammarSpec) -> str:
    return asyncio.run(compiler.compile(spec))


@pytest.mark.parametrize("fields, expected", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA, "strict": True}}},
     GrammarSpec(GrammarKind.JSON_SCHEMA, SCHEMA, "response_format.json_schema.schema")),
    ({"response_format": {"type": "json_object"}}, GrammarSpec(GrammarKind.JSON_OBJECT, None, "response_format")),
    ({"response_format": {"type": "text"}}, None),
    ({"guided_json": SCHEMA}, GrammarSpec(GrammarKind.JSON_SCHEMA, SCHEMA, "guided_json")),
    ({"guided_json": '{"type": "integer"}'}, GrammarSpec(GrammarKind.JSON_SCHEMA, {"type": "integer"}, "guided_json")),
    ({"guided_regex": "[a-z]+"}, GrammarSpec(GrammarKind.REGEX, "[a-z]+", "guided_regex")),
    ({"guided_choice": ["yes", "no"]}, GrammarSpec(GrammarKind.CHOICE, ["yes", "no"], "guided_choice")),
    ({"guided_grammar": 'start: "a"'}, GrammarSpec(GrammarKind.GRAMMAR, 'start: "a"', "guided_grammar")),
    ({"structured_outputs": {"choice": ["a"]}}, GrammarSpec(GrammarKind.CHOICE, ["a"], "structured_outputs.choice")),
    ({"structured_outputs": {"json": SCHEMA, "disable_any_whitespace": False}},
     GrammarSpec(GrammarKind.JSON_SCHEMA, SCHEMA, "structured_outputs.json", ANY_WHITESPACE)),
    ({"structured_outputs": {"json_object": True}},
     GrammarSpec(GrammarKind.JSON_OBJECT, None, "structured_outputs.json_object")),
    ({"guided_json": SCHEMA, "guided_whitespace_pattern": " ?"},
     GrammarSpec(GrammarKind.JSON_SCHEMA, SCHEMA, "guided_json", " ?")),
])
def test_each_way_of_asking_reads_into_one_spec_on_both_endpoints(fields, expected):
    assert grammar_spec(fields) == expected
    assert parse_completion_request({"prompt": "hi", **fields}).grammar == expected
    assert parse_chat_request({**CHAT, **fields}).grammar == expected


@pytest.mark.parametrize("fields, param", [
    ({"guided_json": SCHEMA, "guided_regex": "a"}, "guided_regex"),
    ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}}, "structured_outputs.regex"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
    ({"structured_outputs": {}}, "structured_outputs"),
    ({"structured_outputs": {"structural_tag": "{}"}}, "structured_outputs.structural_tag"),
    ({"response_format": {"type": "bogus"}}, "response_format.type"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": 3}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "strict": "yes"}}},
     "response_format.json_schema.strict"),
    ({"guided_json": "{not json"}, "guided_json"),
    ({"guided_choice": []}, "guided_choice"),
    ({"guided_choice": ["a", 1]}, "guided_choice"),
    ({"guided_regex": ""}, "guided_regex"),
    ({"guided_whitespace_pattern": " "}, "guided_whitespace_pattern"),
    ({"guided_regex": "a", "guided_whitespace_pattern": " "}, "guided_whitespace_pattern"),
])
def test_two_constraints_or_a_malformed_one_is_a_400_naming_the_field(fields, param):
    with pytest.raises(ApiError) as info:
        grammar_spec(fields)
    assert (info.value.status, info.value.param) == (400, param)


def test_the_responses_api_reads_text_format_and_echoes_it():
    text = {"format": {"type": "json_schema", "name": "x", "schema": SCHEMA, "strict": True}}
    request = parse_responses_request({"input": "hi", "text": text})
    assert request.grammar == GrammarSpec(GrammarKind.JSON_SCHEMA, SCHEMA, "text.format.schema")
    assert request.text == text and request.generation_request().grammar == request.grammar
    assert parse_responses_request({"input": "hi", "text": {"format": {"type": "text"}}}).grammar is None
    assert parse_responses_request({"input": "hi", "text": {"format": {"type": "json_object"}}}).grammar.kind \
        is GrammarKind.JSON_OBJECT
    with pytest.raises(ApiError) as info:
        parse_responses_request({"input": "hi", "text": {"format": {"type": "json_schema"}}})
    assert info.value.param == "text.format.schema"


def test_every_kind_compiles_to_a_grammar_llguidance_accepts(compiler):
    for spec in [GrammarSpec(GrammarKind.JSON_SCHEMA, SCHEMA, "p"), GrammarSpec(GrammarKind.JSON_OBJECT, None, "p"),
                 GrammarSpec(GrammarKind.REGEX, "[0-9]{2}", "p"), GrammarSpec(GrammarKind.CHOICE, ["a", "b"], "p"),
                 GrammarSpec(GrammarKind.GRAMMAR, 'start: "a" | "b"', "p"),
                 GrammarSpec(GrammarKind.GRAMMAR, 'root ::= "a" | "b"', "p"),  # GBNF
                 GrammarSpec(GrammarKind.JSON_SCHEMA, SCHEMA, "p", " ?")]:
        assert llguidance.LLMatcher.validate_grammar(compile_spec(compiler, spec)) == "", spec


@pytest.mark.parametrize("spec, message", [
    (GrammarSpec(GrammarKind.JSON_SCHEMA, {"type": "bogus"}, "response_format.json_schema.schema"), "bogus"),
    (GrammarSpec(GrammarKind.JSON_SCHEMA, {"type": "array", "uniqueItems": True}, "guided_json"), "uniqueItems"),
    (GrammarSpec(GrammarKind.REGEX, "(abc", "guided_regex"), "unclosed group"),
    (GrammarSpec(GrammarKind.GRAMMAR, "start: foo", "guided_grammar"), "foo"),
])
def test_a_constraint_that_does_not_compile_is_a_400_with_llguidances_reason(compiler, spec, message):
    with pytest.raises(ApiError) as info:
        compile_spec(compiler, spec)
    assert (info.value.status, info.value.param) == (400, spec.param) and message in info.value.message


SELF_REFERRING = {"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}}


def test_a_schema_that_allows_nothing_is_a_400_in_plain_words_not_the_parsers_state(compiler):
    spec = GrammarSpec(GrammarKind.JSON_SCHEMA, SELF_REFERRING, "response_format.json_schema.schema")
    with pytest.raises(ApiError) as info:
        compile_spec(compiler, spec)
    assert info.value.message == ("response_format.json_schema.schema is not a constraint this server can follow: it "
                                  "allows no output at all (a $ref that only refers back to itself, say)")


def nested(depth: int) -> dict:
    schema: dict = {"type": "integer"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    return schema


def pathological_schemas() -> dict[str, dict]:
    wide = {"type": "object", "properties": {f"p{i}": {"enum": [f"v{i}-{j}" for j in range(50)]} for i in range(3000)}}
    # 100 levels: llguidance's recursion limit; 300: deeper than the cache key can be written (a body nests to 1,024)
    return {"nested 100": nested(100), "nested 300": nested(300), "huge": wide}


@pytest.mark.parametrize("name", ["nested 100", "nested 300", "huge"])
def test_a_pathological_schema_is_refused_in_bounded_time(compiler, name):
    started = time.monotonic()
    with pytest.raises(ApiError) as info:
        compile_spec(compiler, GrammarSpec(GrammarKind.JSON_SCHEMA, pathological_schemas()[name], "guided_json"))
    assert info.value.status == 400 and time.monotonic() - started < 10.0


@pytest.mark.parametrize("spec, message", [
    (GrammarSpec(GrammarKind.CHOICE, [f"choice {i}" for i in range(20000)], "guided_choice"), "bytes as JSON"),
    (GrammarSpec(GrammarKind.REGEX, "a{99999999}", "guided_regex"), "too many expressions"),  # at the first token
])
def test_a_constraint_too_costly_for_the_worker_is_refused_here(compiler, spec, message):
    with pytest.raises(ApiError) as info:
        compile_spec(compiler, spec)
    assert (info.value.status, info.value.param) == (400, spec.param) and message in info.value.message


def test_an_exponential_regex_compiles_lazily_and_cheaply(compiler):
    started = time.monotonic()
    compile_spec(compiler, GrammarSpec(GrammarKind.REGEX, "((a|aa)*){1,50}(x{1,1000}){1,1000}b", "guided_regex"))
    assert time.monotonic() - started < 10.0


def test_grammars_and_refusals_are_cached_by_the_constraints_text(compiler):
    spec = GrammarSpec(GrammarKind.JSON_SCHEMA, {"type": "object", "properties": {"z": {"type": "string"}}}, "p")
    first = compile_spec(compiler, spec)
    same = GrammarSpec(GrammarKind.JSON_SCHEMA, {"properties": {"z": {"type": "string"}}, "type": "object"}, "p")
    assert compile_spec(compiler, same) is first  # key order does not matter: the very string comes back
    refused = GrammarSpec(GrammarKind.REGEX, "(never closed", "p")
    for _ in range(2):
        with pytest.raises(ApiError):
            compile_spec(compiler, refused)
    assert len([key for key in compiler._cache if b"(never closed" in key]) == 1
