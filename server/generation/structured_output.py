"""Structured output in the frontend: a request's constraint as one checked grammar, cached by its text.

Owns: GrammarSpec (which kind of constraint a request asked for, read by
the APIs from response_format, structured_outputs, guided_* or text.format),
turning it into llguidance's grammar text, and checking that the grammar
compiles against the model's tokenizer: a constraint that does not is a 400
naming the field and llguidance's reason, before the worker ever sees it.
The worker builds its matchers from the same text (gpu_worker/sampling/grammar.py).
Must not know: request bodies, the engine, torch.
How: llguidance is a Rust library with no tie to torch, so the frontend can
compile and check every grammar itself, building its matcher and first mask
as the worker will; its limits (lexer fuel, grammar size, recursion depth),
a cap on the constraint's size and one on the time that build takes bound
what a hostile constraint costs the worker, and the check runs on a worker
thread (llguidance releases the GIL), so the event loop never waits on one.
Checked grammars and refusals are cached by the constraint's canonical
text; JSON is compact by default (no free whitespace between tokens), so a
model cannot wander off into whitespace it was never asked for, and strict
(no keys a schema does not list, unless it allows them: json_schema_strict).
"""

from __future__ import annotations

import asyncio
import enum
import time
from collections import OrderedDict
from dataclasses import dataclass

import llguidance
import numpy as np
import orjson

from server.generation.json_schema_strict import forbid_unlisted_properties
from server.generation.tokenizer import Tokenizer
from server.http.errors import ApiError

CACHED_GRAMMARS = 256  # distinct constraints remembered, with their grammar or their refusal
MAX_CACHED_CHARS = 64 * 1024  # a constraint longer than this is checked again each time rather than kept
# Bounds on what one constraint may cost the worker, which builds its matcher on the thread that runs the steps:
# the constraint's size as canonical JSON, and the time its matcher and first mask take to build here.
MAX_CONSTRAINT_BYTES = 128 * 1024
MAX_BUILD_SECONDS = 0.5


class GrammarKind(enum.Enum):
    JSON_SCHEMA = "json"  # value: the schema (a dict)
    JSON_OBJECT = "json_object"  # any JSON object; value unused
    REGEX = "regex"  # value: a regular expression (Rust's regex syntax)
    CHOICE = "choice"  # value: a list of strings, the output is exactly one of them
    GRAMMAR = "grammar"  # value: a Lark grammar, or a GBNF one (llama.cpp's)


@dataclass(frozen=True, slots=True)
class GrammarSpec:
    kind: GrammarKind
    value: object
    param: str  # the request field it came from, named in a 400
    whitespace_pattern: str | None = None  # JSON kinds: a regex for the whitespace allowed between tokens
    # JSON schemas: an object schema that lists properties allows no others unless it says so (json_schema_strict)
    forbid_unlisted_properties: bool = True

    def cache_key(self) -> bytes:
        return orjson.dumps([self.kind.value, self.value, self.whitespace_pattern, self.forbid_unlisted_properties],
                            option=orjson.OPT_SORT_KEYS)


class GrammarCompiler:
    """Turns GrammarSpecs into checked llguidance grammars against the served model's tokenizer."""

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._cache: OrderedDict[bytes, tuple[str, str]] = OrderedDict()  # key -> (grammar, error or "")

    async def compile(self, spec: GrammarSpec) -> str:
        """The grammar text for `spec`; ApiError 400 naming spec.param when it does not compile."""
        try:
            key = spec.cache_key()
        except TypeError:  # orjson refuses nesting deeper than 254 levels
            raise ApiError(400, f"{spec.param} is nested too deeply to be a constraint", param=spec.param) from None
        if len(key) > MAX_CONSTRAINT_BYTES:
            raise ApiError(400, f"{spec.param} is {len(key):,} bytes as JSON, more than the {MAX_CONSTRAINT_BYTES:,} a "
                                "constraint may be", param=spec.param)
        cached = self._cache.get(key)
        if cached is None:
            cached = await asyncio.get_running_loop().run_in_executor(None, self._check, spec)
            if len(key) <= MAX_CACHED_CHARS:
                self._cache[key] = cached
                if len(self._cache) > CACHED_GRAMMARS:
                    self._cache.popitem(last=False)
        else:
            self._cache.move_to_end(key)
        grammar, error = cached
        if error:
            raise ApiError(400, f"{spec.param} is not a constraint this server can follow: {_first_lines(error)}",
                           param=spec.param)
        return grammar

    def _check(self, spec: GrammarSpec) -> tuple[str, str]:
        """(grammar, "") or ("", why it cannot be followed); runs off the event loop.

        The grammar's matcher is built and its first step taken, as the worker will: some limits (a grammar
        with too many symbols, a counted repetition too large for the lexer) show only there, and the time they
        take is what the worker would spend."""
        try:
            grammar = grammar_text(spec)
            tokenizer = self._llg_tokenizer()
        except ValueError as exc:
            return "", str(exc)
        started = time.perf_counter()
        matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
        if not matcher.is_error():
            _take_first_step(matcher)
        seconds = time.perf_counter() - started
        if matcher.is_error():
            return "", matcher.get_error()
        if seconds > MAX_BUILD_SECONDS:
            return "", f"its grammar took {seconds:.1f} s to build, more than the {MAX_BUILD_SECONDS} s allowed"
        return grammar, ""

    def _llg_tokenizer(self) -> llguidance.LLTokenizer:
        """ValueError when llguidance cannot read the model's tokenizer."""
        if self._tokenizer is None:
            try:
                self._tokenizer = llguidance.LLTokenizer(self.tokenizer.to_json())
            except ValueError as exc:
                raise ValueError(f"structured output cannot use this model's tokenizer: {exc}") from None
        return self._tokenizer


def _take_first_step(matcher: llguidance.LLMatcher) -> None:
    """Compute the first mask and take the first token it allows, then the next mask; errors stay in the matcher."""
    allowed = np.flatnonzero(np.unpackbits(np.frombuffer(matcher.compute_bitmask(), dtype=np.uint8),
                                           bitorder="little"))
    if len(allowed) and not matcher.is_error() and matcher.consume_token(int(allowed[0])):
        matcher.compute_bitmask()


def grammar_text(spec: GrammarSpec) -> str:
    """llguidance's grammar text for `spec`, not yet checked; ValueError for a value llguidance cannot read."""
    if spec.kind in (GrammarKind.JSON_SCHEMA, GrammarKind.JSON_OBJECT):
        schema = spec.value if spec.kind is GrammarKind.JSON_SCHEMA else {"type": "object"}
        if not isinstance(schema, dict):
            raise ValueError(f"a JSON schema must be an object, got a {type(schema).__name__}")
        if spec.forbid_unlisted_properties:
            schema = forbid_unlisted_properties(schema)
        pattern = spec.whitespace_pattern
        return llguidance.LLMatcher.grammar_from_json_schema(
            schema, defaults={"whitespace_flexible": False},  # compact JSON unless a pattern says otherwise
            overrides=None if pattern is None else {"whitespace_pattern": pattern})
    if spec.kind is GrammarKind.REGEX:
        return llguidance.LLMatcher.grammar_from_regex(str(spec.value))
    if spec.kind is GrammarKind.CHOICE:
        return llguidance.grammar_from("choice", orjson.dumps(spec.value).decode())
    return llguidance.grammar_from("grammar", str(spec.value))


# llguidance's reasons for stopping, which it reports with a dump of its parser's state: what each means to a client
STOP_REASONS = {"NoExtensionBias": "it allows no output at all (a $ref that only refers back to itself, say)",
                "NoExtension": "it allows no output at all"}


def _first_lines(error: str, limit: int = 500) -> str:
    """The reason in llguidance's error, without the parser state and grammar it may append, in plain words where
    it is one of its stop reasons."""
    reason = error.split("<state>", 1)[0].split("<grammar>", 1)[0]
    text = " ".join(line.strip() for line in reason.strip().splitlines() if line.strip())
    text = STOP_REASONS.get(text, text) or "its grammar cannot be followed"
    return text if len(text) <= limit else f"{text[:limit]}..."
