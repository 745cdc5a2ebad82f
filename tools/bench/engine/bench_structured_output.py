"""What structured output costs: the same requests with and without a JSON schema, in one engine, one process.

Not a script of its own: `python -m tools.bench.engine.bench_offline
--workload json-schema` runs this. Every one of the requests (64 by default,
all in flight at once) is sampled at temperature 1 with its own seed, once
free and once constrained by a JSON schema of nested objects, strings,
integers and enums whose output cannot end within max_tokens; the free run
ignores EOS, so both produce exactly the same number of tokens and the ratio
of their times is the grammar's cost: the masks computed (by llguidance, in
parallel) and applied in the sampler. The runs alternate (free, constrained,
free, constrained, ...) so drift in a shared machine's speed falls on both.

It also times compiling the schema: in the frontend (GrammarCompiler: the
grammar built and checked against the tokenizer), first and cached, and in
the worker (the matcher built from the grammar text), first and cached,
after each side has loaded its tokenizer (once per process, timed apart).

The default checkpoint (SmolLM-135M's shape, random weights) has no
tokenizer; a byte-level BPE of the model's vocabulary size is trained for it
on this Python's standard library sources (once; kept beside the weights:
tools/benchlib/checkpoints.py's ensure_tokenizer), so that the masks are as
large as a real tokenizer's.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

from gpu_worker.engine.engine import Engine
from gpu_worker.engine.generate import generate
from server.generation.structured_output import GrammarCompiler, GrammarKind, GrammarSpec, grammar_text
from server.generation.tokenizer import Tokenizer as ServedTokenizer
from shared.config import EngineConfig
from shared.sampling_params import SamplingParams

ITEM = {"type": "object", "additionalProperties": False, "required": ["id", "name", "kind", "tags", "owner"],
        "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 100000},
                       "name": {"type": "string", "maxLength": 12},
                       "kind": {"enum": ["alpha", "beta", "gamma", "delta"]},
                       "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 3},
                       "owner": {"type": "object", "additionalProperties": False, "required": ["email", "active"],
                                 "properties": {"email": {"type": "string", "maxLength": 16},
                                                "active": {"type": "boolean"}}}}}
SCHEMA = {"type": "array", "items": ITEM, "minItems": 10000}  # never complete within max_tokens: every run is full


def compile_times(path: Path, engine: Engine) -> tuple[str, dict[str, float]]:
    """The schema's grammar, and how long it takes to compile: frontend and worker, first and cached (seconds)."""
    compiler = GrammarCompiler(ServedTokenizer.from_dir(path))
    spec = GrammarSpec(GrammarKind.JSON_SCHEMA, SCHEMA, "guided_json")
    started = time.perf_counter()
    asyncio.run(compiler.compile(GrammarSpec(GrammarKind.JSON_OBJECT, None, "response_format")))
    engine.grammars.state(grammar_text(GrammarSpec(GrammarKind.JSON_OBJECT, None, "response_format")))
    times = {"tokenizers loaded (both sides, once per process)": time.perf_counter() - started}
    for name in ("frontend first", "frontend cached"):
        started = time.perf_counter()
        grammar = asyncio.run(compiler.compile(spec))
        times[name] = time.perf_counter() - started
    for name in ("worker first", "worker cached"):
        started = time.perf_counter()
        engine.grammars.state(grammar)
        times[name] = time.perf_counter() - started
    return grammar, times


@dataclass(slots=True)
class Run:
    seconds: float
    num_tokens: int
    num_steps: int


def timed_run(engine: Engine, prompts: list[list[int]], params: list[SamplingParams]) -> Run:
    started = time.perf_counter()
    for i, (prompt, request_params) in enumerate(zip(prompts, params)):
        engine.add_request(f"bench-{i}", prompt, request_params)
    num_tokens = num_steps = 0
    while engine.has_work():
        num_tokens += sum(len(out.new_token_ids) for out in engine.step())
        num_steps += 1
    return Run(time.perf_counter() - started, num_tokens, num_steps)


def run_json_schema(path: Path, dtype: str, prompts: list[list[int]], max_output: int, max_num_seqs: int,
                    max_num_batched_tokens: int, rounds: int) -> Run:
    """Print the comparison; returns the last free run (for the roofline)."""
    engine = Engine(EngineConfig(model=str(path), dtype=dtype, max_num_seqs=max_num_seqs,
                                 max_num_batched_tokens=max_num_batched_tokens))
    grammar, times = compile_times(path, engine)
    print("compile the schema: " + ", ".join(f"{name} {seconds * 1e3:.2f} ms" for name, seconds in times.items()))
    num_requests = len(prompts)
    free = [SamplingParams(max_tokens=max_output, temperature=1.0, seed=i, ignore_eos=True)
            for i in range(num_requests)]
    constrained = [SamplingParams(max_tokens=max_output, temperature=1.0, seed=i, grammar=grammar)
                   for i in range(num_requests)]
    generate(engine, prompts[:4], free[:4])  # warm up allocator and threads
    ratios, runs = [], {}
    for round_index in range(rounds):
        for name, params in (("free", free), ("json schema", constrained)):
            runs[name] = run = timed_run(engine, prompts, params)
            if run.num_tokens != num_requests * max_output:
                raise RuntimeError(f"{name}: expected {num_requests * max_output} tokens, got {run.num_tokens}")
            print(f"round {round_index + 1} {name:12s} {run.seconds:7.2f} s  {run.num_tokens / run.seconds:8.1f} "
                  f"output tokens/s  ({run.num_steps} steps)")
        ratios.append(runs["free"].seconds / runs["json schema"].seconds)
    print(f"constrained / free throughput: median {statistics.median(ratios):.3f} "
          f"({', '.join(f'{r:.3f}' for r in ratios)})")
    return runs["free"]
