"""/metrics in tests: the Prometheus text a server answers, as samples, and sums over their label sets.

    samples = parse_metrics(body.decode())  # {'vllm:num_requests_running{model_name="tiny"}': 0.0, ...}
    samples = server.scrape()               # the same, from a RunningServer's GET /metrics
    total(samples, "vllm:prompt_tokens_total")                        # every label set of that name
    total(samples, "pagedserve:worker_restarts_total", cause="fault")  # those whose labels include these
    rise(before, after, "vllm:request_success_total", model_name="tiny")
    num_restarts(samples)                                               # worker restarts, every cause

A sample's key is its name with its labels as the server wrote them (so a test can index one exact series);
comment lines (# HELP, # TYPE) are left out.
"""

from __future__ import annotations

import re

from tools.benchlib.metrics import parse_metrics  # the benchmarks' parser: one for the project

__all__ = ["parse_metrics", "labels_of", "total", "rise", "num_restarts"]

WORKER_RESTARTS = "pagedserve:worker_restarts_total"
SAMPLE = re.compile(r"(?P<name>[^{]+)(?:\{(?P<labels>.*)\})?")
LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def labels_of(key: str) -> tuple[str, dict[str, str]]:
    """A sample key's metric name and labels: 'a{b="c"}' -> ('a', {'b': 'c'})."""
    match = SAMPLE.fullmatch(key)
    assert match is not None, f"not a sample key: {key!r}"
    return match["name"], dict(LABEL.findall(match["labels"] or ""))


def total(samples: dict[str, float], name: str, **labels: str) -> float:
    """The sum of the samples called `name` whose labels include `labels` (0 when there are none)."""
    found = 0.0
    for key, value in samples.items():
        sample_name, sample_labels = labels_of(key)
        if sample_name == name and labels.items() <= sample_labels.items():
            found += value
    return found


def rise(before: dict[str, float], after: dict[str, float], name: str, **labels: str) -> float:
    """How much total(name, labels) rose from one scrape to a later one."""
    return total(after, name, **labels) - total(before, name, **labels)


def num_restarts(samples: dict[str, float], **labels: str) -> float:
    """The worker restarts the server counted, of every cause (or of those with `labels`, e.g. cause="fault")."""
    return total(samples, WORKER_RESTARTS, **labels)
