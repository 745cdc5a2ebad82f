"""Metrics: what /metrics shows, in Prometheus text under vLLM's names, so existing dashboards work.

Owns: a private CollectorRegistry (never prometheus-client's global one, so two
servers in one process or a test never mix), the engine's and supervisor's
series, and the rendering of the text format. vLLM's series carry vLLM's
labels (model_name, engine="0"), pagedserve's own model_name alone; the
names vLLM deprecated and still exports (gpu_cache_usage_perc,
gpu_prefix_cache_*) are exported beside the new ones with the same values.
Must not know: HTTP, routes, the worker's internals.
How: the engine's gauges, totals and per-step histograms (tokens, time,
predicted time) are read from the EngineClient when /metrics is scraped (a
custom collector), so nothing runs per step; the EngineClient adds up what
replaced workers counted, so counters never go down across a restart. So
are the supervisor's (restarts by cause, re-queued and poisoned requests,
the last recovery time, readiness), from any object with the Supervisor's
counters. What the HTTP connections hold comes from a function the server
hands over once it listens (`watch_connections`). Each request is counted
once, when its handler is done with it (`on_request_done`), by vLLM's
per-request series (server/request_metrics.py).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Protocol

from prometheus_client import CollectorRegistry, Gauge, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from server.request_metrics import DEPRECATED, ENGINE, VLLM_LABELS, RequestMetrics, histogram_family
from server.worker.engine_client import EngineClient
from server.worker.request_state import RequestState
from server.worker.sharing import available_memory
from shared.process_memory import resident_bytes
from shared.step_metrics import STEP_COST_TERMS, HistogramCounts
from shared.vocabulary import FinishReason

__all__ = ["CONTENT_TYPE_LATEST", "Metrics"]

LABELS = ("model_name",)  # pagedserve's own series; vLLM's carry VLLM_LABELS
HTTP_HOLDERS = ("request_bodies", "write_buffers")


class _EngineCollector:
    """The engine's gauges and counters, read from the EngineClient at scrape time."""

    def __init__(self, engine_client: EngineClient, model_name: str):
        self._engine_client = engine_client
        self._model_name = model_name
        self.connections_held_bytes: Callable[[], dict[str, int]] | None = None  # set once the server listens

    def collect(self) -> Iterator[Metric]:
        client, labels = self._engine_client, [self._model_name]
        yield from self._collect_vllm()
        yield _gauge("pagedserve:prefix_cache_blocks", "Full KV blocks held by the prefix cache.", labels,
                     client.totals.stats.num_cached_blocks)
        recovery = CounterMetricFamily("pagedserve:recovery_tokens", "Positions of the requests in flight that a failed "
                                       "worker had computed, whose KV the next worker adopted from the shared cache "
                                       "or computed again.", labels=(*LABELS, "kind"))
        recovery.add_metric([self._model_name, "adopted"], client.totals.total("num_adopted_tokens_total"))
        recovery.add_metric([self._model_name, "recomputed"], client.totals.total("num_recomputed_tokens_total"))
        yield recovery
        yield _counter("pagedserve:kv_block_audit_failures", "Idle KV block audits that found a block neither free "
                       "nor held by the prefix cache (a leak; the worker logs which).", labels,
                       client.totals.total("num_block_audit_failures_total"))
        yield from self._collect_memory(labels)
        yield _gauge("pagedserve:standby_worker_ready", "1 while a standby engine worker is loaded and waiting to "
                     "take over, else 0.", labels, 1.0 if client.standbys.has_ready_standby else 0.0)
        yield _gauge("pagedserve:standby_worker_missing", "1 while the server has lost its standby engine worker: "
                     "the last attempt to start one failed and none is ready (a worker death then costs a full "
                     "restart), else 0.", labels, 1.0 if client.standbys.is_missing else 0.0)
        yield _gauge("pagedserve:worker_cpu_threads", "The engine worker's compute threads on the CPU now (0 on a "
                     "GPU, and until its first stats): fewer than it started with while other busy processes share "
                     "its CPUs (its log says when).", labels, client.totals.stats.cpu_threads)
        yield _gauge("pagedserve:kv_cache_shared", "1 while the engine worker's KV cache is in the shared segment "
                     "(a successor adopts what it computed), 0 while it is private to the worker.", labels,
                     1.0 if client.worker_info is not None and client.worker_info.kv_shared else 0.0)
        yield from self._collect_steps(labels)

    def _collect_vllm(self) -> Iterator[Metric]:
        """vLLM's engine series under its names and labels, with the deprecated names vLLM still exports."""
        client, labels = self._engine_client, [self._model_name, ENGINE]
        stats, totals = client.totals.stats, client.totals
        num_prompt, cache_hits = totals.num_prompt_tokens, totals.total("prefix_cache_hits_total")
        gauges = [("vllm:num_requests_running", "Number of requests in model execution batches.", stats.num_running),
                  ("vllm:num_requests_waiting", "Number of requests waiting to be processed.", stats.num_waiting),
                  *_with_deprecated("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc",
                                    "KV-cache usage. 1 means 100 percent usage.", stats.kv_cache_usage)]
        counters = [("vllm:prompt_tokens", "Number of prefill tokens processed.", num_prompt),
                    ("vllm:prompt_tokens_cached", "Number of cached prompt tokens (local + external).", cache_hits),
                    ("vllm:generation_tokens", "Number of generation tokens processed.", totals.num_generation_tokens),
                    ("vllm:num_preemptions", "Cumulative number of preemption from the engine.",
                     totals.total("num_preemptions_total")),
                    *_with_deprecated("vllm:prefix_cache_queries", "vllm:gpu_prefix_cache_queries", "Prefix cache "
                                      "queries, in terms of number of queried tokens.",
                                      totals.total("prefix_cache_queries_total")),
                    *_with_deprecated("vllm:prefix_cache_hits", "vllm:gpu_prefix_cache_hits", "Prefix cache hits, in "
                                      "terms of number of cached tokens.", cache_hits)]
        for name, documentation, value in gauges:
            yield _gauge(name, documentation, labels, value, VLLM_LABELS)
        for name, documentation, value in counters:
            yield _counter(name, documentation, labels, value, VLLM_LABELS)
        waiting = GaugeMetricFamily("vllm:num_requests_waiting_by_reason", "Number of waiting requests by reason: "
                                    "capacity (waiting for room in the batch or the KV cache), deferred (none here).",
                                    labels=(*VLLM_LABELS, "reason"))
        waiting.add_metric([*labels, "capacity"], stats.num_waiting)
        waiting.add_metric([*labels, "deferred"], 0)
        yield waiting
        sleep = GaugeMetricFamily("vllm:engine_sleep_state", "Engine sleep state: awake is 1 (this engine does not "
                                  "sleep).", labels=(*VLLM_LABELS, "sleep_state"))
        for state, value in (("awake", 1), ("weights_offloaded", 0), ("discard_all", 0)):
            sleep.add_metric([*labels, state], value)
        yield sleep
        by_source = CounterMetricFamily("vllm:prompt_tokens_by_source", "Number of prompt tokens by source: "
                                        "local_compute, local_cache_hit (the prefix cache), external_kv_transfer "
                                        "(none here).", labels=(*VLLM_LABELS, "source"))
        by_source.add_metric([*labels, "local_compute"], max(0.0, num_prompt - cache_hits))
        by_source.add_metric([*labels, "local_cache_hit"], cache_hits)
        by_source.add_metric([*labels, "external_kv_transfer"], 0)
        yield by_source
        yield histogram_family("vllm:iteration_tokens_total", "Histogram of number of tokens per engine_step.",
                               labels, totals.step_histograms().histograms["iteration_tokens"], VLLM_LABELS)

    def _collect_memory(self, labels: list[str]) -> Iterator[Metric]:
        """The worker's resident memory as its latest stats split it, and the frontend's, read now."""
        stats = self._engine_client.totals.stats
        worker = GaugeMetricFamily("pagedserve:worker_memory_bytes", "The engine worker's resident memory (rss), and "
                                   "what it is made of: weights in host memory, the KV cache in host memory, "
                                   "malloc's cache of freed memory (allocator_cache), and the rest (unexplained).",
                                   labels=(*LABELS, "kind"))
        for kind in WORKER_MEMORY_KINDS:
            worker.add_metric([*labels, kind], getattr(stats, f"{kind}_bytes"))
        yield worker
        cuda = GaugeMetricFamily("pagedserve:worker_cuda_memory_bytes", "The engine worker's device memory on CUDA, "
                                 "as torch counts it: allocated, and reserved (allocated plus its cache).",
                                 labels=(*LABELS, "kind"))
        cuda.add_metric([*labels, "allocated"], stats.cuda_allocated_bytes)
        cuda.add_metric([*labels, "reserved"], stats.cuda_reserved_bytes)
        yield cuda
        rss = resident_bytes()
        yield _gauge("pagedserve:frontend_memory_bytes", "The frontend's resident memory (NaN where unreadable).",
                     labels, float("nan") if rss is None else rss)
        available = available_memory()
        yield _gauge("pagedserve:memory_available_bytes", "Bytes the server's processes could still allocate: the "
                     "machine's MemAvailable, capped by the room left under the cgroup's memory.max (NaN where "
                     "unreadable). Near 0, the kernel's OOM killer is next.", labels,
                     float("nan") if available is None else available)
        in_flight = self._engine_client.in_flight
        yield _gauge("pagedserve:frontend_requests_in_flight", "Requests the frontend holds in flight (each with its "
                     "tokens so far): the frontend's largest holder of memory under load.", labels, len(in_flight))
        yield _gauge("pagedserve:frontend_request_tokens", "Tokens the frontend's requests in flight hold: their "
                     "prompts and their outputs so far.", labels,
                     sum(len(state.prompt_token_ids) + len(state.output_token_ids) for state in in_flight.values()))
        if self.connections_held_bytes is not None:
            held = self.connections_held_bytes()
            family = GaugeMetricFamily("pagedserve:frontend_held_bytes", "Bytes the frontend's HTTP connections "
                                       "hold: request bodies arrived and not yet answered (request_bodies), "
                                       "responses written and not yet taken by the kernel (write_buffers).",
                                       labels=(*LABELS, "holder"))
            for holder in HTTP_HOLDERS:
                family.add_metric([*labels, holder], held[holder])
            yield family

    def _collect_steps(self, labels: list[str]) -> Iterator[Metric]:
        """The workers' step histograms, and the current worker's step-cost model."""
        histograms = self._engine_client.totals.step_histograms().histograms
        for name, (metric, documentation) in _STEP_HISTOGRAMS.items():
            yield histogram_family(metric, documentation, labels, histograms[name], LABELS)
        cost = GaugeMetricFamily("pagedserve:step_cost_seconds", "The worker's step-cost model: seconds a step "
                                 "takes per unit of each term (a step, a token, a sampled row, a prefill (query, "
                                 "key) pair, a context token a decode reads).", labels=(*LABELS, "term"))
        for term in STEP_COST_TERMS:
            cost.add_metric([*labels, term], self._engine_client.totals.stats.step_cost.get(term, float("nan")))
        yield cost


WORKER_MEMORY_KINDS = ("rss", "weights", "kv_cache", "allocator_cache", "unexplained")

# StepHistograms name -> (metric name, help); iteration_tokens is vLLM's, with the others in _collect_vllm
_STEP_HISTOGRAMS = {
    "step_seconds": ("pagedserve:step_seconds", "Engine step time (forward pass, sampling, bookkeeping), in seconds."),
    "predicted_step_seconds": ("pagedserve:step_predicted_seconds",
                               "Engine step time the step-cost model predicted before each step, in seconds."),
    "step_prediction_ratio": ("pagedserve:step_prediction_ratio",
                              "Each engine step's actual time over its predicted time (1 is exact)."),
}


class SupervisorCounters(Protocol):
    """What the metrics read of the Supervisor."""

    restarts_by_cause: dict[str, int]
    requests_requeued_total: int
    requests_poisoned_total: int
    restarts_forgiven_total: int
    last_recovery_seconds: float | None
    recovery_first_token: HistogramCounts

    @property
    def is_ready(self) -> bool: ...

    @property
    def restarts_remaining(self) -> int: ...


class _SupervisorCollector:
    """The supervisor's counters, read at scrape time."""

    def __init__(self, supervisor: SupervisorCounters, model_name: str):
        self._supervisor = supervisor
        self._model_name = model_name

    def collect(self) -> Iterator[Metric]:
        supervisor, labels = self._supervisor, [self._model_name]
        restarts = CounterMetricFamily("pagedserve:worker_restarts", "Engine worker restarts, by cause (exit, "
                                       "signal, hang, start_failure; memory and max_requests: recycled).",
                                       labels=(*LABELS, "cause"))
        for cause, count in supervisor.restarts_by_cause.items():
            restarts.add_metric([self._model_name, cause], count)
        yield restarts
        yield _counter("pagedserve:requests_requeued", "Requests re-sent to a new worker after a worker failure.",
                       labels, supervisor.requests_requeued_total)
        yield _counter("pagedserve:requests_poisoned", "Requests failed for being in the failing step of too "
                       "many consecutive worker failures.", labels, supervisor.requests_poisoned_total)
        yield _counter("pagedserve:worker_restarts_forgiven", "Worker restarts taken off the restart limit: blamed on "
                       "a request failed as poison, with a worker serving again since.", labels,
                       supervisor.restarts_forgiven_total)
        recovery = supervisor.last_recovery_seconds
        yield _gauge("pagedserve:worker_last_recovery_seconds", "Seconds from detecting the last worker failure "
                     "to the new worker's READY (NaN before any).", labels, float("nan") if recovery is None else recovery)
        yield _gauge("pagedserve:worker_ready", "1 while an engine worker is ready and making progress, else 0.",
                     labels, 1.0 if supervisor.is_ready else 0.0)
        yield _gauge("pagedserve:worker_restarts_remaining", "Worker deaths the restart limit still allows within "
                     "its window (--max-worker-restarts, --restart-window); at 0 the next death makes the server "
                     "give up and exit.", labels, supervisor.restarts_remaining)
        yield histogram_family("pagedserve:worker_recovery_first_token_seconds", "Seconds from detecting a worker "
                               "failure to the first token the next worker produced.", labels,
                               supervisor.recovery_first_token, LABELS)


def _with_deprecated(name: str, deprecated: str, documentation: str, value: float) -> list[tuple[str, str, float]]:
    """A series and the older name vLLM still exports beside it, with the same value and its DEPRECATED help."""
    return [(name, documentation, value), (deprecated, documentation + DEPRECATED.format(name), value)]


def _gauge(name: str, documentation: str, labels: list[str], value: float,
           label_names: tuple[str, ...] = LABELS) -> GaugeMetricFamily:
    family = GaugeMetricFamily(name, documentation, labels=label_names)
    family.add_metric(labels, value)
    return family


def _counter(name: str, documentation: str, labels: list[str], value: float,
             label_names: tuple[str, ...] = LABELS) -> CounterMetricFamily:
    family = CounterMetricFamily(name, documentation, labels=label_names)  # exposed as name + "_total"
    family.add_metric(labels, value)
    return family


class Metrics:
    """The server's metrics; `render()` is the body of GET /metrics, served as CONTENT_TYPE_LATEST."""

    def __init__(self, engine_client: EngineClient, model_name: str, supervisor: SupervisorCounters | None = None):
        self.model_name = model_name
        self.registry = CollectorRegistry(auto_describe=True)
        self._engine_collector = _EngineCollector(engine_client, model_name)
        self.registry.register(self._engine_collector)
        started = Gauge("pagedserve:server_start_time_seconds", "When this server started, in seconds since the "
                        "epoch: a change is a restart of the whole server (a crash loop shows as many).", LABELS,
                        registry=self.registry)
        started.labels(model_name).set(time.time())
        if supervisor is not None:
            self.registry.register(_SupervisorCollector(supervisor, model_name))
        self._requests = RequestMetrics(self.registry, model_name, lambda: _max_model_len(engine_client))

    def watch_connections(self, held_bytes: Callable[[], dict[str, int]]) -> None:
        """Report what the HTTP connections hold, by `held_bytes()` (HttpServer.held_bytes) at each scrape."""
        self._engine_collector.connections_held_bytes = held_bytes

    def on_request_done(self, state: RequestState, finish_reason: str | None = None) -> None:
        """Count one request (one choice) the handler has finished with.

        `finish_reason` (the handler's outcome) overrides the state's: a stop
        string matched in the frontend ends the request with "stop" though the
        engine saw an abort. A request that failed counts as "error".
        """
        self._requests.observe(state, finish_reason or state.finish_reason or FinishReason.ABORT.value)

    def render(self) -> bytes:
        return generate_latest(self.registry)


def _max_model_len(engine_client: EngineClient) -> int | None:
    return None if engine_client.worker_info is None else engine_client.worker_info.max_model_len
