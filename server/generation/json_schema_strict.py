"""Strict JSON schemas: an object schema that lists its properties allows no others unless it says so.

JSON Schema's own default lets an object carry any key its schema does not
list, and a model will write them: pydantic's model_json_schema(), instructor
and langchain send schemas without "additionalProperties", and a small model
then runs on with keys of its own until max_tokens. vLLM's default backend
compiles schemas in a strict mode that forbids them; so does this server,
unless the request's structured_outputs.disable_additional_properties is
false. Only schemas that list properties (or patternProperties) are made
strict: one that says "additionalProperties" or "unevaluatedProperties"
itself keeps what it says, and a bare {"type": "object"} stays any object.
"""

from __future__ import annotations

# Keywords whose value is a schema, a list of schemas, or a map from names to schemas (JSON Schema 2020-12, with
# the draft-07 spellings pydantic and older clients still send).
_SCHEMA_KEYWORDS = ("additionalProperties", "items", "additionalItems", "contains", "not", "if", "then", "else",
                    "propertyNames", "unevaluatedItems", "unevaluatedProperties")
_SCHEMA_LIST_KEYWORDS = ("anyOf", "oneOf", "allOf", "prefixItems", "items")
_SCHEMA_MAP_KEYWORDS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


def forbid_unlisted_properties(schema: dict) -> dict:
    """A copy of `schema` in which every object schema listing properties and saying nothing of the others has
    "additionalProperties": false; everything else as it was."""
    strict = _strict(schema)
    assert isinstance(strict, dict)
    return strict


def _strict(schema: object) -> object:
    if not isinstance(schema, dict):
        return schema
    strict = dict(schema)
    for keyword in _SCHEMA_KEYWORDS:
        if isinstance(schema.get(keyword), dict):
            strict[keyword] = _strict(schema[keyword])
    for keyword in _SCHEMA_LIST_KEYWORDS:
        if isinstance(schema.get(keyword), list):
            strict[keyword] = [_strict(item) for item in schema[keyword]]
    for keyword in _SCHEMA_MAP_KEYWORDS:
        if isinstance(schema.get(keyword), dict):
            strict[keyword] = {name: _strict(item) for name, item in schema[keyword].items()}
    lists_properties = "properties" in schema or "patternProperties" in schema
    if lists_properties and "additionalProperties" not in schema and "unevaluatedProperties" not in schema:
        strict["additionalProperties"] = False
    return strict
