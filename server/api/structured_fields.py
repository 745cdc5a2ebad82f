"""The request fields that ask for structured output, read into one GrammarSpec (or None).

OpenAI's `response_format` ({"type": "json_object"} or {"type": "json_schema",
"json_schema": {"name", "schema", "strict"}}) and, as vLLM takes them,
`structured_outputs` ({"json" | "regex" | "choice" | "grammar" |
"json_object", "whitespace_pattern", "disable_any_whitespace",
"disable_additional_properties"}) and the
older `guided_json`, `guided_regex`, `guided_choice`, `guided_grammar`,
`guided_whitespace_pattern`, on /v1/completions and /v1/chat/completions;
the Responses API's `text.format` (the same json_schema fields, flattened).
A request names at most one constraint; two are a 400. Whether a
constraint compiles is the GrammarCompiler's to say (server/generation/
structured_output.py); here only its shape is checked, each error naming
the field. `strict` changes nothing: the schema is always enforced.
JSON is compact unless a whitespace pattern is given, or
`disable_any_whitespace` is false (vLLM's default: any whitespace). JSON
schemas are strict (an object that lists its properties takes no others
unless it says so) unless `disable_additional_properties` is false, which
gives JSON Schema's own default back.
"""

from __future__ import annotations

import dataclasses

import orjson

from server.api.body_fields import get_field
from server.generation.structured_output import GrammarKind, GrammarSpec
from server.http.errors import ApiError, describe_value

ANY_WHITESPACE = r"[\n\t ]*"  # disable_any_whitespace: false
STRUCTURED_OUTPUTS_KEYS = {"json": GrammarKind.JSON_SCHEMA, "regex": GrammarKind.REGEX,
                           "choice": GrammarKind.CHOICE, "grammar": GrammarKind.GRAMMAR}
GUIDED_FIELDS = {"guided_json": GrammarKind.JSON_SCHEMA, "guided_regex": GrammarKind.REGEX,
                 "guided_choice": GrammarKind.CHOICE, "guided_grammar": GrammarKind.GRAMMAR}
# structured_outputs' other keys; disable_fallback and backend change nothing here (one backend, no fallback)
_STRUCTURED_OUTPUTS_OPTIONS = {"json_object", "whitespace_pattern", "disable_any_whitespace", "disable_fallback",
                               "backend", "disable_additional_properties"}


def grammar_spec(body: dict) -> GrammarSpec | None:
    """The one constraint a completions or chat request asks for, or None."""
    specs = [spec for spec in (_response_format(body.get("response_format")),
                               _structured_outputs(body.get("structured_outputs")),
                               *(_value_spec(kind, body.get(name), name) for name, kind in GUIDED_FIELDS.items()))
             if spec is not None]
    if len(specs) > 1:
        raise ApiError(400, f"a request may ask for one kind of structured output, got {specs[0].param} and "
                            f"{specs[1].param}", param=specs[1].param)
    pattern = get_field(body, "guided_whitespace_pattern", str, "a string", None)
    if not specs:
        if pattern is not None:
            raise ApiError(400, "guided_whitespace_pattern needs a JSON constraint", param="guided_whitespace_pattern")
        return None
    return _with_whitespace(specs[0], pattern, "guided_whitespace_pattern")


def text_format_spec(text: object) -> GrammarSpec | None:
    """The Responses API's `text` field: {"format": {"type": "text" | "json_object" | "json_schema", ...}}."""
    if text is None:
        return None
    if not isinstance(text, dict):
        raise ApiError(400, f"text must be an object, got {describe_value(text)}", param="text")
    unknown = sorted(set(text) - {"format"})
    if unknown:
        raise ApiError(400, f"text.{unknown[0]} is not supported", param=f"text.{unknown[0]}")
    fmt = text.get("format")
    if fmt is None:
        return None
    return _format(fmt, "text.format", fmt if isinstance(fmt, dict) else {})


def _response_format(value: object) -> GrammarSpec | None:
    if value is None:
        return None
    if not isinstance(value, dict):
        raise ApiError(400, f"response_format must be an object, got {describe_value(value)}", param="response_format")
    return _format(value, "response_format", value.get("json_schema"))


def _format(value: object, where: str, json_schema: object) -> GrammarSpec | None:
    """{"type": ...} of response_format (json_schema nested) or of text.format (json_schema's fields beside type)."""
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return GrammarSpec(GrammarKind.JSON_OBJECT, None, where)
    if kind != "json_schema":
        raise ApiError(400, f"{where}.type must be \"text\", \"json_object\" or \"json_schema\", got "
                            f"{describe_value(kind)}", param=f"{where}.type")
    inner = f"{where}.json_schema" if where == "response_format" else where
    if not isinstance(json_schema, dict):
        raise ApiError(400, f"{inner} must be an object with the schema, got {describe_value(json_schema)}",
                       param=inner)
    name = json_schema.get("name")
    if name is not None and not isinstance(name, str):
        raise ApiError(400, f"{inner}.name must be a string, got {describe_value(name)}", param=f"{inner}.name")
    get_field(json_schema, "strict", bool, "a boolean", None, where=f"{inner}.")
    schema = json_schema.get("schema")
    if schema is None and where == "response_format":
        return GrammarSpec(GrammarKind.JSON_SCHEMA, {}, f"{inner}.schema")  # optional here: any JSON value
    if schema is None:
        raise ApiError(400, f"{inner}.schema is required", param=f"{inner}.schema")
    return _value_spec(GrammarKind.JSON_SCHEMA, schema, f"{inner}.schema")


def _structured_outputs(value: object) -> GrammarSpec | None:
    if value is None:
        return None
    if not isinstance(value, dict):
        raise ApiError(400, f"structured_outputs must be an object, got {describe_value(value)}",
                       param="structured_outputs")
    for key in value:
        if key not in STRUCTURED_OUTPUTS_KEYS and key not in _STRUCTURED_OUTPUTS_OPTIONS:
            raise ApiError(400, f"structured_outputs.{key} is not supported", param=f"structured_outputs.{key}")
    specs = [_value_spec(kind, value.get(key), f"structured_outputs.{key}")
             for key, kind in STRUCTURED_OUTPUTS_KEYS.items()]
    if get_field(value, "json_object", bool, "a boolean", False, where="structured_outputs."):
        specs.append(GrammarSpec(GrammarKind.JSON_OBJECT, None, "structured_outputs.json_object"))
    found = [spec for spec in specs if spec is not None]
    if len(found) != 1:
        raise ApiError(400, "structured_outputs must name exactly one of json, regex, choice, grammar or "
                            f"json_object, got {len(found)}", param="structured_outputs")
    pattern = get_field(value, "whitespace_pattern", str, "a string", None, where="structured_outputs.")
    if pattern is None and get_field(value, "disable_any_whitespace", bool, "a boolean", True,
                                     where="structured_outputs.") is False:
        pattern = ANY_WHITESPACE
    spec = _with_whitespace(found[0], pattern, "structured_outputs.whitespace_pattern")
    if not get_field(value, "disable_additional_properties", bool, "a boolean", True, where="structured_outputs."):
        spec = dataclasses.replace(spec, forbid_unlisted_properties=False)
    return spec


def _value_spec(kind: GrammarKind, value: object, param: str) -> GrammarSpec | None:
    """A constraint given by its value: a schema (object, or JSON text), a regex, a choice list, a grammar."""
    if value is None:
        return None
    if kind is GrammarKind.JSON_SCHEMA:
        if isinstance(value, str):
            try:
                value = orjson.loads(value)
            except orjson.JSONDecodeError as exc:
                raise ApiError(400, f"{param} must be a JSON schema, got text that is not JSON: {exc}",
                               param=param) from None
        if not isinstance(value, (dict, bool)):
            raise ApiError(400, f"{param} must be a JSON schema (an object), got {describe_value(value)}", param=param)
        return GrammarSpec(kind, {} if value is True else value, param)
    if kind is GrammarKind.CHOICE:
        if not isinstance(value, list) or not value or not all(isinstance(v, str) and v for v in value):
            raise ApiError(400, f"{param} must be a non-empty list of non-empty strings, got {describe_value(value)}",
                           param=param)
        return GrammarSpec(kind, value, param)
    if not isinstance(value, str) or not value:
        raise ApiError(400, f"{param} must be a non-empty string, got {describe_value(value)}", param=param)
    return GrammarSpec(kind, value, param)


def _with_whitespace(spec: GrammarSpec, pattern: str | None, param: str) -> GrammarSpec:
    if pattern is None:
        return spec
    if spec.kind not in (GrammarKind.JSON_SCHEMA, GrammarKind.JSON_OBJECT):
        raise ApiError(400, f"{param} applies to JSON constraints only, not to {spec.param}", param=param)
    return dataclasses.replace(spec, whitespace_pattern=pattern)
