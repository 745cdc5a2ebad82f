"""The benchmarks' workloads: synthetic prompts of random token ids, or a JSONL file of requests.

Synthetic: lengths drawn uniformly from the ranges, ids from MIN_TOKEN_ID up,
seeded, so every side of a comparison (and every benchmark: the HTTP ones
send the ids as the completions API's prompt, the engine ones add them as
they are) gets the same requests. JSONL: one {"prompt": text or token ids,
"max_tokens": n} per line.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

MIN_TOKEN_ID = 3  # past the usual <unk>, <s>, </s>
DEFAULT_VOCAB_SIZE = 500  # random ids below this are valid in any real vocabulary (and in the tests' tiny one)


@dataclass(slots=True)
class BenchRequest:
    prompt: str | list[int]
    max_tokens: int


def synthetic_workload(num_requests: int, prompt_len: tuple[int, int], output_len: tuple[int, int], vocab_size: int,
                       seed: int) -> list[BenchRequest]:
    rng = random.Random(seed)
    return [BenchRequest([rng.randrange(MIN_TOKEN_ID, vocab_size) for _ in range(rng.randint(*prompt_len))],
                         rng.randint(*output_len)) for _ in range(num_requests)]


def load_workload(path: Path) -> list[BenchRequest]:
    requests = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if line.strip():
            item = json.loads(line)
            if not isinstance(item.get("prompt"), (str, list)) or not isinstance(item.get("max_tokens"), int):
                raise ValueError(f"{path}:{number}: expected {{\"prompt\": str | [ids], \"max_tokens\": int}}, "
                                 f"got {line[:100]}")
            requests.append(BenchRequest(item["prompt"], item["max_tokens"]))
    return requests


def vocab_size_of(model_dir: Path) -> int:
    return json.loads((model_dir / "config.json").read_text())["vocab_size"]
