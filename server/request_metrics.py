"""The per-request series of /metrics, as vLLM exports them: one observation per finished choice.

Owns: vLLM's request histograms (latencies and phases, token counts, the n
and max_tokens parameters) and the request_success counter, with vLLM's
names, help, labels ("model_name", "engine") and bucket edges, and the
deprecated names vLLM still exports in its deprecation window
(time_per_output_token_seconds beside inter_token_latency_seconds).
Must not know: HTTP, the engine's gauges (server/metrics.py), the worker.
How: each choice is observed once, when its handler is done with it, from
the timestamps its RequestState carries: arrival (queued), the start of the
first step a worker ran of it (scheduled), its first and last token. The
phases are vLLM's: queue = scheduled - arrival, prefill = first token -
scheduled, decode = last - first token, inference = last token - scheduled;
a request re-queued after a worker death keeps its first scheduling, so its
outage shows in prefill or decode. Token-count histograms use vLLM's 1-2-5
edges up to max_model_len, known once a worker is ready; n and the largest
output among a prompt's choices are observed once per prompt, when its last
choice is done.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import HistogramMetricFamily
from prometheus_client.utils import floatToGoString

from server.worker.request_state import RequestState
from shared.step_metrics import HistogramCounts
from shared.vocabulary import FinishReason

# vLLM's bucket edges, in seconds
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
               40.0, 80.0)
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                           240.0, 480.0, 960.0, 1920.0, 7680.0)
N_BUCKETS = (1, 2, 5, 10, 20)
VLLM_LABELS = ("model_name", "engine")
ENGINE = "0"  # vLLM's engine index; one engine here
FINISHED_REASONS = tuple(reason.value for reason in FinishReason)
DEPRECATED = "DEPRECATED: Use {} instead."


def one_two_five_buckets(max_value: int) -> tuple[int, ...]:
    """vLLM's token-count edges: 1, 2, 5, 10, 20, 50, ... while not above `max_value`."""
    edges, scale = [], 1
    while True:
        for mantissa in (1, 2, 5):
            if mantissa * scale > max_value:
                return tuple(edges)
            edges.append(mantissa * scale)
        scale *= 10


class RequestMetrics:
    """vLLM's per-request series in `registry`; `observe(state, outcome)` once per finished choice."""

    def __init__(self, registry: CollectorRegistry, model_name: str, max_model_len: Callable[[], int | None]):
        self._registry = registry
        self._labels = (model_name, ENGINE)
        self._max_model_len = max_model_len
        self._success = Counter("vllm:request_success", "Count of successfully processed requests.",
                                (*VLLM_LABELS, "finished_reason"), registry=registry)
        for reason in FINISHED_REASONS:
            self._success.labels(*self._labels, reason)
        latency = [("e2e", "vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.",
                    REQUEST_LATENCY_BUCKETS),
                   ("ttft", "vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                    TTFT_BUCKETS),
                   ("request_tpot", "vllm:request_time_per_output_token_seconds",
                    "Histogram of time_per_output_token_seconds per request.", ITL_BUCKETS),
                   ("queue", "vllm:request_queue_time_seconds", "Histogram of time spent in WAITING phase for "
                    "request.", REQUEST_LATENCY_BUCKETS),
                   ("inference", "vllm:request_inference_time_seconds", "Histogram of time spent in RUNNING phase "
                    "for request.", REQUEST_LATENCY_BUCKETS),
                   ("prefill", "vllm:request_prefill_time_seconds", "Histogram of time spent in PREFILL phase for "
                    "request.", REQUEST_LATENCY_BUCKETS),
                   ("decode", "vllm:request_decode_time_seconds", "Histogram of time spent in DECODE phase for "
                    "request.", REQUEST_LATENCY_BUCKETS),
                   ("n", "vllm:request_params_n", "Histogram of the n request parameter.", N_BUCKETS)]
        self._histograms = {key: Histogram(name, documentation, VLLM_LABELS, buckets=buckets,
                                           registry=registry).labels(*self._labels)
                            for key, name, documentation, buckets in latency}
        self._token_histograms: dict[str, Histogram] | None = None  # once max_model_len is known
        self._gaps = _GapHistograms(self._labels)
        registry.register(self._gaps)
        self._unreported: dict[int, int] = {}  # id(a prompt's choices) -> how many are not done yet

    def observe(self, state: RequestState, outcome: str) -> None:
        """One finished choice: `outcome` is its finish reason ("error" for one that failed)."""
        reason = FinishReason.ERROR.value if state.error is not None else outcome
        self._success.labels(*self._labels, reason if reason in FINISHED_REASONS else FinishReason.STOP.value).inc()
        observe = self._histograms
        observe["e2e"].observe(time.monotonic() - state.arrival_time)
        if state.scheduled_time is not None:
            observe["queue"].observe(state.scheduled_time - state.arrival_time)
        first, last = state.first_token_time, state.last_token_time
        num_outputs = len(state.output_token_ids)
        if first is not None:
            observe["ttft"].observe(first - state.arrival_time)
            if state.scheduled_time is not None:
                observe["prefill"].observe(first - state.scheduled_time)
        if first is not None and last is not None:
            decode = last - first
            observe["decode"].observe(decode)
            if state.scheduled_time is not None:
                observe["inference"].observe(last - state.scheduled_time)
            mean_gap = decode / (num_outputs - 1) if num_outputs > 1 else 0.0
            observe["request_tpot"].observe(mean_gap)
            # The mean gap, once per gap: the histogram's count and sum equal the per-token ones, without a
            # timestamp per token (one step's tokens arrive together anyway).
            self._gaps.counts.observe(mean_gap, num_outputs - 1)
        tokens = self._tokens()
        if tokens is None:
            return
        tokens["prompt"].observe(len(state.prompt_token_ids))
        tokens["generation"].observe(num_outputs)
        if state.params.max_tokens:
            tokens["max_tokens"].observe(state.params.max_tokens)
        self._observe_prompt_done(state, tokens)

    def _observe_prompt_done(self, state: RequestState, tokens: dict[str, Histogram]) -> None:
        """n and the largest output among a prompt's choices, once its last choice is done."""
        choices = state.prompt_choices or [state]
        key = id(choices)
        remaining = self._unreported.get(key, len(choices)) - 1
        if remaining > 0:
            self._unreported[key] = remaining
            return
        self._unreported.pop(key, None)
        self._histograms["n"].observe(len(choices))
        tokens["max_generation"].observe(max(len(choice.output_token_ids) for choice in choices))

    def _tokens(self) -> dict[str, Histogram] | None:
        """The token-count histograms, made at the first call that knows max_model_len (None before)."""
        if self._token_histograms is None:
            max_model_len = self._max_model_len()
            if max_model_len is None:
                return None
            buckets = one_two_five_buckets(max_model_len)
            made = [("prompt", "vllm:request_prompt_tokens", "Number of prefill tokens processed."),
                    ("generation", "vllm:request_generation_tokens", "Number of generation tokens processed."),
                    ("max_tokens", "vllm:request_params_max_tokens", "Histogram of the max_tokens request "
                     "parameter."),
                    ("max_generation", "vllm:request_max_num_generation_tokens", "Histogram of maximum number of "
                     "requested generation tokens.")]
            self._token_histograms = {key: Histogram(name, documentation, VLLM_LABELS, buckets=buckets,
                                                     registry=self._registry).labels(*self._labels)
                                      for key, name, documentation in made}
        return self._token_histograms


class _GapHistograms:
    """vLLM's inter-token latency histogram and its deprecated twin, which take each request's mean gap once per
    gap: counted here, one bucket search a request, where a prometheus_client Histogram takes one observation a
    call (two calls a token, each with a lock and a linear bucket search)."""

    METRICS = (("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds."),
               ("vllm:time_per_output_token_seconds", "Histogram of time per output token in seconds."
                + DEPRECATED.format("vllm:inter_token_latency_seconds")))

    def __init__(self, labels: tuple[str, str]) -> None:
        self.counts = HistogramCounts(ITL_BUCKETS)
        self._labels = list(labels)

    def collect(self) -> Iterator[HistogramMetricFamily]:
        for name, documentation in self.METRICS:
            yield histogram_family(name, documentation, self._labels, self.counts, VLLM_LABELS)


def histogram_family(name: str, documentation: str, labels: list[str], histogram: HistogramCounts,
                     label_names: tuple[str, ...]) -> HistogramMetricFamily:
    """`histogram` as a Prometheus histogram `name` with `labels` (values of `label_names`)."""
    family = HistogramMetricFamily(name, documentation, labels=label_names)
    family.add_metric(labels, [(floatToGoString(bound), count) for bound, count in histogram.cumulative_counts()],
                      histogram.total)
    return family
