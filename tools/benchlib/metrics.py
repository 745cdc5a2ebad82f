"""A server's /metrics and /health as the benchmarks read them, and polling until something holds.

Only the standard library.
"""

from __future__ import annotations

import time
import urllib.error
import urllib.request
from collections.abc import Callable

POLL_S = 0.02
TIMEOUT_S = 120.0
GET_TIMEOUT_S = 10.0


def get(base_url: str, path: str, headers: dict[str, str] | None = None) -> tuple[int, bytes]:
    """GET base_url + path: (status, body), an HTTP error's included."""
    request = urllib.request.Request(base_url + path, headers=headers or {})
    try:
        with urllib.request.urlopen(request, timeout=GET_TIMEOUT_S) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def parse_metrics(text: str) -> dict[str, float]:
    """The samples of a /metrics answer by name with labels, e.g. 'pagedserve:worker_restarts_total{cause="hang",...}';
    comment lines (# HELP, # TYPE) are left out."""
    samples = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            samples[name] = float(value)
    return samples


def scrape(base_url: str) -> dict[str, float]:
    """The samples of base_url's /metrics (parse_metrics)."""
    return parse_metrics(get(base_url, "/metrics")[1].decode())


def total(samples: dict[str, float], name: str, label: str = "") -> float:
    """The sum of a metric over its label sets (those that hold `label`, e.g. 'kind="adopted"', when given)."""
    return sum(v for k, v in samples.items() if k.split("{")[0] == name and label in k)


def has_metric(samples: dict[str, float], name: str) -> bool:
    return any(k.split("{")[0] == name for k in samples)


def histogram_mean(before: dict[str, float], after: dict[str, float], name: str) -> float | None:
    """The mean of the observations a histogram gained between two scrapes; None if it has none (or no such metric)."""
    count = total(after, f"{name}_count") - total(before, f"{name}_count")
    return (total(after, f"{name}_sum") - total(before, f"{name}_sum")) / count if count else None


def is_healthy(base_url: str) -> bool:
    return get(base_url, "/health")[0] == 200


def wait_until(predicate: Callable[[], object], what: str, timeout: float = TIMEOUT_S) -> float:
    """Polls every POLL_S until predicate() is true; when it became so. TimeoutError, naming `what`, past timeout."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out waiting for {what}")
        time.sleep(POLL_S)
    return time.monotonic()
