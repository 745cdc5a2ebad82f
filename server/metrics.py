"""Metrics: what /metrics shows, in Prometheus text under vLLM's names, so existing dashboards work.

Owns: a private CollectorRegistry (never prometheus-client's global one, so two
servers in one process or a test never mix), the per-request histograms and
the request_success counter, and the rendering of the text format.
Must not know: HTTP, routes, the worker's internals.
How: the engine's gauges, totals and per-step histograms (tokens, time,
predicted time) are read from the EngineClient when /metrics is scraped (a
custom collector), so nothing runs per step; the EngineClient adds up what
replaced workers counted, so counters never go down across a restart. So
are the supervisor's (restarts by cause, re-queued and poisoned requests,
the last recovery time, readiness), from any object with the Supervisor's
counters. What the HTTP connections hold comes from a function the server
hands over once it listens (`watch_connections`). Each request is counted
once, when its handler is done with it (`on_request_done`), from the
timestamps its RequestState carries.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Protocol

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.utils import floatToGoString

from server.worker.engine_client import EngineClient
from server.worker.request_state import RequestState
from shared.process_memory import resident_bytes
from shared.step_metrics import STEP_COST_TERMS, HistogramCounts
from shared.vocabulary import FinishReason

__all__ = ["CONTENT_TYPE_LATEST", "Metrics"]

# vLLM's bucket edges, in seconds.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
               40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
               480.0, 960.0, 1920.0, 7680.0)
LABELS = ("model_name",)
HTTP_HOLDERS = ("request_bodies", "write_buffers")


class _EngineCollector:
    """The engine's gauges and counters, read from the EngineClient at scrape time."""

    def __init__(self, engine_client: EngineClient, model_name: str):
        self._engine_client = engine_client
        self._model_name = model_name
        self.connections_held_bytes: Callable[[], dict[str, int]] | None = None  # set once the server listens

    def collect(self) -> Iterator[Metric]:
        client, labels = self._engine_client, [self._model_name]
        stats = client.totals.stats
        yield _gauge("vllm:num_requests_running", "Number of requests in model execution batches.", labels,
                     stats.num_running)
        yield _gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.", labels,
                     stats.num_waiting)
        yield _gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", labels,
                     stats.kv_cache_usage)
        yield _counter("vllm:prompt_tokens", "Number of prefill tokens processed.", labels,
                       client.totals.num_prompt_tokens)
        yield _counter("vllm:generation_tokens", "Number of generation tokens processed.", labels,
                       client.totals.num_generation_tokens)
        yield _counter("vllm:num_preemptions", "Cumulative number of preemptions from the engine.", labels,
                       client.totals.total("num_preemptions_total"))
        yield _counter("vllm:prefix_cache_queries", "Prefix cache queries, in tokens.", labels,
                       client.totals.total("prefix_cache_queries_total"))
        yield _counter("vllm:prefix_cache_hits", "Prefix cache hits, in tokens.", labels,
                       client.totals.total("prefix_cache_hits_total"))
        yield _gauge("pagedserve:prefix_cache_blocks", "Full KV blocks held by the prefix cache.", labels,
                     stats.num_cached_blocks)
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
        yield _gauge("pagedserve:kv_cache_shared", "1 while the engine worker's KV cache is in the shared segment "
                     "(a successor adopts what it computed), 0 while it is private to the worker.", labels,
                     1.0 if client.worker_info is not None and client.worker_info.kv_shared else 0.0)
        yield from self._collect_steps(labels)

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
            yield _histogram(metric, documentation, labels, histograms[name])
        cost = GaugeMetricFamily("pagedserve:step_cost_seconds", "The worker's step-cost model: seconds a step "
                                 "takes per unit of each term (a step, a token, a sampled row, a prefill (query, "
                                 "key) pair, a context token a decode reads).", labels=(*LABELS, "term"))
        for term in STEP_COST_TERMS:
            cost.add_metric([*labels, term], self._engine_client.totals.stats.step_cost.get(term, float("nan")))
        yield cost


WORKER_MEMORY_KINDS = ("rss", "weights", "kv_cache", "allocator_cache", "unexplained")

# StepHistograms name -> (metric name, help)
_STEP_HISTOGRAMS = {
    "iteration_tokens": ("vllm:iteration_tokens_total", "Histogram of number of tokens per engine_step."),
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
        yield _histogram("pagedserve:worker_recovery_first_token_seconds", "Seconds from detecting a worker failure "
                         "to the first token the next worker produced.", labels, supervisor.recovery_first_token)


def _gauge(name: str, documentation: str, labels: list[str], value: float) -> GaugeMetricFamily:
    family = GaugeMetricFamily(name, documentation, labels=LABELS)
    family.add_metric(labels, value)
    return family


def _histogram(name: str, documentation: str, labels: list[str], histogram: HistogramCounts) -> HistogramMetricFamily:
    family = HistogramMetricFamily(name, documentation, labels=LABELS)
    family.add_metric(labels, [(floatToGoString(bound), count) for bound, count in histogram.cumulative_counts()],
                      histogram.total)
    return family


def _counter(name: str, documentation: str, labels: list[str], value: float) -> CounterMetricFamily:
    family = CounterMetricFamily(name, documentation, labels=LABELS)  # exposed as name + "_total"
    family.add_metric(labels, value)
    return family


class Metrics:
    """The server's metrics; `render()` is the body of GET /metrics, served as CONTENT_TYPE_LATEST."""

    def __init__(self, engine_client: EngineClient, model_name: str, supervisor: SupervisorCounters | None = None):
        self.model_name = model_name
        self.registry = CollectorRegistry(auto_describe=True)
        self._engine_collector = _EngineCollector(engine_client, model_name)
        self.registry.register(self._engine_collector)
        if supervisor is not None:
            self.registry.register(_SupervisorCollector(supervisor, model_name))
        self._success = Counter("vllm:request_success", "Count of successfully processed requests.",
                                ("model_name", "finished_reason"), registry=self.registry)
        self._ttft = Histogram("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                               LABELS, buckets=TTFT_BUCKETS, registry=self.registry).labels(model_name)
        self._itl = Histogram("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
                              LABELS, buckets=ITL_BUCKETS, registry=self.registry).labels(model_name)
        self._e2e = Histogram("vllm:e2e_request_latency_seconds",
                              "Histogram of end to end request latency in seconds.", LABELS,
                              buckets=E2E_BUCKETS, registry=self.registry).labels(model_name)

    def watch_connections(self, held_bytes: Callable[[], dict[str, int]]) -> None:
        """Report what the HTTP connections hold, by `held_bytes()` (HttpServer.held_bytes) at each scrape."""
        self._engine_collector.connections_held_bytes = held_bytes

    def on_request_done(self, state: RequestState, finish_reason: str | None = None) -> None:
        """Count one request (one choice) the handler has finished with.

        `finish_reason` (the handler's outcome) overrides the state's: a stop
        string matched in the frontend ends the request with "stop" though the
        engine saw an abort. A request that failed ("error", or state.error)
        counts in the latencies it reached but not as a success.
        """
        reason = finish_reason or state.finish_reason
        if reason not in (None, FinishReason.ERROR) and state.error is None:
            self._success.labels(self.model_name, reason).inc()
        self._e2e.observe(time.monotonic() - state.arrival_time)
        if state.first_token_time is None:
            return
        self._ttft.observe(state.first_token_time - state.arrival_time)
        num_gaps = len(state.output_token_ids) - 1
        if num_gaps > 0 and state.last_token_time is not None:
            # The mean gap, once per gap: the histogram's count and sum equal the per-token ones,
            # without a timestamp per token (one step's tokens arrive together anyway).
            mean_gap = (state.last_token_time - state.first_token_time) / num_gaps
            for _ in range(num_gaps):
                self._itl.observe(mean_gap)

    def render(self) -> bytes:
        return generate_latest(self.registry)
