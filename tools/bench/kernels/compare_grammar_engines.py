"""llguidance against xgrammar, the two grammar engines made for structured output: mask cost and schema coverage.

Why pagedserve uses llguidance is measured here. Both engines get the same
byte-level BPE (trained on this Python's standard library, as the
structured-output benchmark trains it) and the same JSON schemas. For each
schema each engine compiles it, then walks five seeded random paths through
it, picking uniformly among the tokens its mask allows (the walk's own cost
is not timed), and the time to compute a mask is averaged over the tokens.
Coverage: a list of JSON Schema features, each compiled by both; a feature
an engine accepts without enforcing it is not told apart here from one it
enforces (the README and the closing figures say which, from the engines'
documentation and their warnings).

xgrammar is not a dependency of pagedserve (it imports torch, so the
frontend could not use it); install it to run this:

    pip install xgrammar
    python -m tools.bench.kernels.compare_grammar_engines --vocab-size 32000
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from tools.benchlib.checkpoints import ensure_tokenizer

SCHEMAS = {
    "person": {"type": "object", "required": ["name", "age", "tags", "address"],
               "properties": {"name": {"type": "string", "maxLength": 20},
                              "age": {"type": "integer", "minimum": 0, "maximum": 150},
                              "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 4},
                              "address": {"type": "object", "required": ["city", "zip"],
                                          "properties": {"city": {"type": "string"},
                                                         "zip": {"type": "string", "pattern": "^[0-9]{5}$"}}}}},
    "anyOf": {"type": "object", "required": ["v"],
              "properties": {"v": {"anyOf": [{"type": "number", "minimum": -5, "maximum": 5}, {"type": "boolean"},
                                             {"type": "null"}]}}},
}
FEATURES = {
    "$ref, recursive": {"$defs": {"node": {"type": "object", "required": ["v"], "properties": {
        "v": {"type": "integer"}, "kids": {"type": "array", "items": {"$ref": "#/$defs/node"}}}}},
        "$ref": "#/$defs/node"},
    "oneOf": {"oneOf": [{"type": "integer"}, {"type": "string"}]},
    "allOf": {"allOf": [{"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
                        {"type": "object", "properties": {"b": {"type": "string"}}, "required": ["b"]}]},
    "format: date-time": {"type": "string", "format": "date-time"},
    "format: email": {"type": "string", "format": "email"},
    "exclusiveMinimum/Maximum": {"type": "number", "exclusiveMinimum": 0, "exclusiveMaximum": 1},
    "const": {"const": "x"},
    "prefixItems": {"type": "array", "prefixItems": [{"type": "integer"}, {"type": "string"}], "items": False},
    "minItems/maxItems": {"type": "array", "items": {"type": "integer"}, "minItems": 2, "maxItems": 3},
    "uniqueItems": {"type": "array", "items": {"type": "integer"}, "uniqueItems": True},
    "patternProperties": {"type": "object", "patternProperties": {"^x_": {"type": "integer"}}},
    "additionalProperties: false": {"type": "object", "properties": {"a": {"type": "integer"}},
                                    "additionalProperties": False},
    "not": {"not": {"type": "string"}},
    "multipleOf": {"type": "integer", "multipleOf": 3},
    "minProperties": {"type": "object", "minProperties": 1},
    "if/then": {"if": {"properties": {"a": {"const": 1}}}, "then": {"required": ["b"]}},
    "an unknown type": {"type": "bogus"},
}
NUM_WALKS = 5
MAX_WALK_TOKENS = 300
EOS = 2
_BITS = np.arange(32, dtype=np.uint32)


class Engine:
    """One grammar engine behind the few calls this comparison makes."""

    name: str

    def compile(self, schema: dict) -> object: ...
    def walk(self, compiled: object, rng: np.random.Generator) -> tuple[float, int]: ...  # (mask seconds, tokens)


class LLGuidance(Engine):
    name = "llguidance"

    def __init__(self, tokenizer_file: Path):
        import llguidance
        import llguidance.numpy

        self.llg, self.numpy = llguidance, llguidance.numpy
        self.tokenizer = llguidance.LLTokenizer(str(tokenizer_file))

    def compile(self, schema: dict) -> object:
        grammar = self.llg.LLMatcher.grammar_from_json_schema(schema, defaults={"whitespace_flexible": False})
        error = self.llg.LLMatcher.validate_grammar(grammar, self.tokenizer)
        if error:
            raise ValueError(error)
        return grammar

    def walk(self, compiled: object, rng: np.random.Generator) -> tuple[float, int]:
        matcher = self.llg.LLMatcher(self.tokenizer, str(compiled))
        bitmask = self.numpy.allocate_token_bitmask(1, self.tokenizer.vocab_size)

        def fill() -> np.ndarray:
            self.numpy.fill_next_token_bitmask(matcher, bitmask, 0)
            return bitmask[0]
        return _walk(fill, matcher.consume_token, self.tokenizer.vocab_size, rng)


class XGrammar(Engine):
    name = "xgrammar"

    def __init__(self, tokenizer_file: Path):
        import xgrammar
        from transformers import PreTrainedTokenizerFast

        hf = PreTrainedTokenizerFast(tokenizer_file=str(tokenizer_file), eos_token="</s>")
        self.xgr = xgrammar
        self.info = xgrammar.TokenizerInfo.from_huggingface(hf, vocab_size=hf.vocab_size)
        self.compiler = xgrammar.GrammarCompiler(self.info, max_threads=1)

    def compile(self, schema: dict) -> object:
        return self.compiler.compile_json_schema(json.dumps(schema), any_whitespace=False)

    def walk(self, compiled: object, rng: np.random.Generator) -> tuple[float, int]:
        matcher = self.xgr.GrammarMatcher(compiled)
        bitmask = self.xgr.allocate_token_bitmask(1, self.info.vocab_size)

        def fill() -> np.ndarray:
            matcher.fill_next_token_bitmask(bitmask)
            return bitmask[0].numpy()
        return _walk(fill, matcher.accept_token, self.info.vocab_size, rng)


def _walk(fill: Callable[[], np.ndarray], accept: Callable[[int], bool], vocab_size: int,
          rng: np.random.Generator) -> tuple[float, int]:
    seconds, num_tokens = 0.0, 0
    for _ in range(MAX_WALK_TOKENS):
        started = time.perf_counter()
        words = fill()
        seconds += time.perf_counter() - started
        num_tokens += 1
        allowed = np.flatnonzero(((words.view(np.uint32)[:, None] >> _BITS) & 1).reshape(-1)[:vocab_size])
        if len(allowed) == 0:
            break
        token = EOS if EOS in allowed and rng.random() < 0.3 else int(rng.choice(allowed))
        if token == EOS or not accept(token):
            break
    return seconds, num_tokens


def compare(engines: list[Engine]) -> None:
    for schema_name, schema in SCHEMAS.items():
        for engine in engines:
            started = time.perf_counter()
            compiled = engine.compile(schema)
            compile_ms = (time.perf_counter() - started) * 1e3
            walks = [engine.walk(compiled, np.random.default_rng(seed)) for seed in range(NUM_WALKS)]
            seconds, tokens = sum(w[0] for w in walks), sum(w[1] for w in walks)
            print(f"{schema_name:8s} {engine.name:11s} compile {compile_ms:7.2f} ms   mask {seconds / tokens * 1e6:6.1f} us "
                  f"per token over {tokens} tokens")
    print(f"\n{'feature':30s}" + "".join(f"{engine.name:>14s}" for engine in engines))
    for feature, schema in FEATURES.items():
        cells = []
        for engine in engines:
            try:
                engine.compile(schema)
                cells.append("compiles")
            except Exception as exc:  # noqa: BLE001 - each engine's own error types; the message is the result
                cells.append("refuses")
                print(f"  {engine.name} refuses {feature}: {str(exc).strip().splitlines()[0][:100]}")
        print(f"{feature:30s}" + "".join(f"{cell:>14s}" for cell in cells))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vocab-size", type=int, default=32000, help="the trained tokenizer's size")
    parser.add_argument("--work-dir", type=Path, default=Path(tempfile.gettempdir()) / "pagedserve-grammar-engines",
                        help="where the trained tokenizer is kept between runs")
    args = parser.parse_args(argv)
    directory = args.work_dir / f"bpe-{args.vocab_size}"
    directory.mkdir(parents=True, exist_ok=True)
    ensure_tokenizer(directory, args.vocab_size)
    compare([LLGuidance(directory / "tokenizer.json"), XGrammar(directory / "tokenizer.json")])


if __name__ == "__main__":
    main()
