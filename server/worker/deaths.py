"""What a worker's death is charged to: the requests suspected of causing it, and the restart budget.

Owns: PoisonTracker (which requests are failed as poison) and RestartBudget
(how many deaths the supervisor tolerates before it gives up).
Must not know: processes, sockets, the supervisor's states.
How: the suspects of a death are the requests that were in the step that
died (the worker names them in its Fatal), or, when it died without a word
(a kill, a hang), the requests it had scheduled at all. Requests that were
only queued are never suspects. A request that is a suspect in
max_deaths deaths in a row without progress is poison: it is failed and
never sent again.

A death blamed on requests that were then failed as poison is forgiven,
taken off the restart budget, once a later worker has made progress on
other requests. That cannot hide a real crash loop: forgiveness needs a
failed request that will never be sent again, so each poison request buys
at most max_deaths deaths (one more, see below), and it needs a worker that
then served others; a worker that dies whatever it serves never gets there,
its deaths stay on the budget, and the supervisor gives up as before.
Deaths with no suspect (a worker that dies idle or at start-up) always count.

A worker that dies before its first step, with only requests resumed from
the worker before it scheduled (nothing new came in with it), died of
something any request would have met (a takeover's mapping, its own start):
the death is its own, not its suspects' (PoisonTracker.excuses). Once in a
row: a request that kills every worker in its first step still becomes
poison, one death later than otherwise.
"""

from __future__ import annotations

import collections
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field

from server.worker.request_state import RequestState


class PoisonTracker:
    """Counts, per request in flight, the consecutive worker deaths it was a suspect in without progress.

    A death counts against a suspect unless it made real progress on that
    worker. One new token is not enough: a resumed request's re-prefill
    samples a token before its first decode step, so a request that kills
    the worker in decode still shows one token per worker; two show that a
    decode step went through. A request that was not a suspect keeps its count.
    """

    MIN_PROGRESS_TOKENS = 2

    def __init__(self, max_deaths: int) -> None:
        self.max_deaths = max_deaths
        self._deaths: dict[str, int] = {}
        self._tokens_at_ready: dict[str, int] = {}
        self._excused_last = False  # the last death was excused (excuses()): the next one is not

    def on_worker_ready(self, in_flight: Mapping[str, RequestState]) -> None:
        self._tokens_at_ready = {rid: len(state.output_token_ids) for rid, state in in_flight.items()}

    def excuses(self, suspects: Collection[str], before_first_step: bool) -> bool:
        """Whether a death is the worker's own rather than its suspects' (the module docstring says when); to be
        asked once per death, before on_worker_death, which is then given no suspects for an excused one."""
        excused = (before_first_step and bool(suspects) and not self._excused_last
                   and all(rid in self._tokens_at_ready for rid in suspects))
        self._excused_last = excused
        return excused

    def on_worker_death(self, in_flight: Mapping[str, RequestState], suspects: Collection[str]
                        ) -> list[RequestState]:
        """Count this death against `suspects`; return the requests that reached max_deaths (to be failed)."""
        deaths = {}
        for rid, state in in_flight.items():
            progress = len(state.output_token_ids) - self._tokens_at_ready.get(rid, 0)
            if progress >= self.MIN_PROGRESS_TOKENS:
                deaths[rid] = 0
            else:
                deaths[rid] = self._deaths.get(rid, 0) + (1 if rid in suspects else 0)
        self._deaths = deaths  # requests that left flight are forgotten
        return [in_flight[rid] for rid, n in deaths.items() if n >= self.max_deaths]

    def deaths(self, request_id: str) -> int:
        return self._deaths.get(request_id, 0)


@dataclass(slots=True)
class _Death:
    time: float
    suspects: frozenset[str]
    is_forgiven: bool = False  # blamed on a request failed as poison; off the budget once a worker makes progress


@dataclass(slots=True)
class RestartBudget:
    """At most max_restarts counted deaths within `window` seconds; the one after that means giving up."""

    max_restarts: int
    window: float
    _deaths: collections.deque[_Death] = field(default_factory=collections.deque)

    def record(self, now: float, suspects: Collection[str]) -> None:
        self._deaths.append(_Death(now, frozenset(suspects)))

    def num_counted(self, now: float) -> int:
        """Deaths within the window that still count (those recorded and not yet forgiven)."""
        while self._deaths and now - self._deaths[0].time > self.window:
            self._deaths.popleft()
        return len(self._deaths)

    def is_spent(self, now: float) -> bool:
        return self.num_counted(now) >= self.max_restarts

    def blame_poison(self, request_ids: Collection[str]) -> None:
        """These requests were failed as poison: the deaths they were suspects in may be forgiven."""
        for death in self._deaths:
            if not death.suspects.isdisjoint(request_ids):
                death.is_forgiven = True

    def on_progress(self) -> int:
        """A worker made progress since the poison was failed: forgive; returns how many deaths were."""
        kept = collections.deque(death for death in self._deaths if not death.is_forgiven)
        num_forgiven = len(self._deaths) - len(kept)
        self._deaths = kept
        return num_forgiven

    @property
    def has_forgivable(self) -> bool:
        return any(death.is_forgiven for death in self._deaths)
