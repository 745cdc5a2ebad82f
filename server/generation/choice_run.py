"""ChoiceRun: one request's choices in flight, from their admission to the engine to their last piece.

Owns: sending each choice's RequestState to the EngineClient, waking the
handler whenever a choice changed or the client left, turning the change
into the choice's next Piece, aborting in the worker what is no longer
wanted (a stop string matched, the client left, the handler is done), and
reporting each choice once to `on_request_done`.
Must not know: JSON shapes, SSE, routes; the endpoints that read a run
(api/completions, api/responses) render its pieces.
How: each choice's RequestState calls back on every change, which queues
the choice (once until `next()` takes it) on one queue that `next()` reads
alongside the client's disconnect: a token wakes the handler's task and no
other.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable
from dataclasses import dataclass, field

from server.generation.choice_output import ChoiceOutput, Piece, TokenEntry
from server.http.errors import RETRY_AFTER_S, ApiError
from server.http.server import ClientDisconnected, Responder
from server.worker.engine_client import EngineClient
from server.worker.request_state import RequestState
from shared.vocabulary import FinishReason


@dataclass(slots=True)
class Collected:
    """One choice read to its end (ChoiceRun.collect)."""

    pieces: list[str] = field(default_factory=list)
    entries: list[TokenEntry] = field(default_factory=list)

    def add(self, piece: Piece) -> None:
        self.pieces.append(piece.text)
        self.entries.extend(piece.entries)

    @property
    def text(self) -> str:
        return "".join(self.pieces)


def choice_error(out: ChoiceOutput) -> ApiError:
    """The error response for a choice that failed before a response was started."""
    if out.state.error is None:
        raise RuntimeError(f"expected a failed choice, got request {out.state.request_id} without an error")
    status = 400 if out.state.error_type == "invalid_request_error" else 500
    return ApiError(status, out.state.error, type=out.state.error_type)


class _Watcher:
    """Yields each choice when its RequestState changes; raises ClientDisconnected once the client is gone."""

    def __init__(self, outputs: list[ChoiceOutput], responder: Responder):
        self._queue: asyncio.Queue[ChoiceOutput | None] = asyncio.Queue()
        self._queued: set[ChoiceOutput] = set()  # changed since next() last took them
        self._outputs = outputs
        for out in outputs:
            out.state.listener = functools.partial(self._changed, out)
        self._client_task = asyncio.create_task(self._watch_client(responder))

    def _changed(self, out: ChoiceOutput) -> None:
        if out not in self._queued:
            self._queued.add(out)
            self._queue.put_nowait(out)
        if out.state.is_finished:
            out.state.listener = None  # queued with its end: nothing after it is for this run

    async def _watch_client(self, responder: Responder) -> None:
        await responder.disconnected.wait()
        self._queue.put_nowait(None)

    async def next(self) -> ChoiceOutput:
        out = await self._queue.get()
        if out is None:
            raise ClientDisconnected("the client closed the connection")
        self._queued.discard(out)
        return out

    def close(self) -> None:
        for out in self._outputs:
            out.state.listener = None
        self._client_task.cancel()


class ChoiceRun:
    """One request's choices in flight: sent to the engine on enter, read piece by piece, stopped on exit.

    On exit whatever still runs is aborted in the worker, and every choice not
    yet reported is reported to on_request_done as "abort".
    """

    def __init__(self, engine_client: EngineClient, outputs: list[ChoiceOutput], responder: Responder,
                 on_request_done: Callable[[RequestState, str], None] | None):
        self.outputs = outputs
        self._engine_client = engine_client
        self._responder = responder
        self._on_request_done = on_request_done
        self._reported: set[int] = set()
        self._watcher: _Watcher | None = None

    @property
    def is_finished(self) -> bool:
        return all(out.is_finished for out in self.outputs)

    async def __aenter__(self) -> ChoiceRun:
        self._watcher = _Watcher(self.outputs, self._responder)
        try:
            for out in self.outputs:
                self._engine_client.add(out.state)
        except RuntimeError as exc:  # the engine client is closed: the server is shutting down
            self._stop()
            raise ApiError(503, f"the server cannot take requests now: {exc}", headers={"Retry-After": RETRY_AFTER_S}) from exc
        except BaseException:
            self._stop()
            raise
        return self

    async def __aexit__(self, *exc_info) -> None:
        self._stop()

    async def next(self) -> tuple[ChoiceOutput, Piece | None]:
        """The next choice that changed and its new piece; a failed choice (its state.error set) comes with None.

        Raises ClientDisconnected once the client is gone.
        """
        if self._watcher is None:
            raise RuntimeError("ChoiceRun.next: expected a run entered (async with), got one not entered")
        out = await self._watcher.next()
        if out.state.error is not None:
            self._report(out, FinishReason.ERROR.value)
            return out, None
        piece = out.advance()
        if out.finish_reason is not None:  # it is finished
            if out.stopped_by_string:
                self._engine_client.abort(out.state.request_id)
            self._report(out, out.finish_reason)
        return out, piece

    async def collect(self) -> list[Collected]:
        """Read every choice to its end: each one's whole text and token entries, by index. A choice that failed
        raises its error (choice_error): nothing was sent to the client yet."""
        collected = [Collected() for _ in self.outputs]
        while not self.is_finished:
            out, piece = await self.next()
            if out.state.error is not None:
                raise choice_error(out)
            if piece is not None:
                collected[out.index].add(piece)
        return collected

    def _stop(self) -> None:
        if self._watcher is not None:  # __aenter__ makes it before anything that may stop the run
            self._watcher.close()
        for out in self.outputs:  # what is still running is no longer wanted
            self._engine_client.abort(out.state.request_id)
            self._report(out, FinishReason.ABORT.value)

    def _report(self, out: ChoiceOutput, outcome: str) -> None:
        if out.index in self._reported:
            return
        self._reported.add(out.index)
        if self._on_request_done is not None:
            self._on_request_done(out.state, outcome)
