"""StepCostModel: how long a step will take, learned from the steps the engine runs.

A step's time is modelled as linear in what it holds (its StepShape):

    seconds = step + token x new tokens + sample x sampled rows
              + prefill_pair x (query, key) pairs of its prefill chunks
              + decode_pair x context tokens its decodes read

`step` is the fixed cost of a forward pass (on a CPU mostly reading the
weights), `token` the matmul rows, `sample` the LM head and sampler rows,
and the two attention terms their different costs: a prefill chunk's
attention is arithmetic over n x (context + n/2) pairs, a decode's is reading
its context's KV once.

The coefficients are a weighted least-squares fit of the steps the engine
ran, with a forgetting factor so that the fit follows the machine as it is
now (about the last STEP_MEMORY steps count). Every reader of the fit (the
latency target sizing a prefill chunk) gets it refreshed with every step
observed so far. The engine's own per-step prediction, the one its
histograms and the clipping below compare a step with, may be up to
MAX_STALE_STEPS steps old: so a run of steps that only decode, which asks
the target nothing, solves the fit every MAX_STALE_STEPS steps rather than
every step (a solve costs ~25 us warm and ~100 us right after a forward
pass). A fit that lags the load for the target's own reads is what made the
ITL p99 overrun when the solve was simply done every 8th step (6c30429).
A server's steps look much alike, so they pin down some combinations of the
terms and say next to nothing of others; the engine's calibration at
start-up (a few steps of shapes chosen to tell the terms apart, prefills
alone and decodes alone, `calibrate`) therefore stays in the fit as a light
anchor: it settles what the steps leave open and is outweighed where they
do not. Errors are weighed relative to the step time, so a 2 ms decode and
a 2 s prefill count alike. Robust and bounded: a step's observed time
enters clipped to [1/CLIP_FACTOR, CLIP_FACTOR] x the prediction, so one step
slowed by a busy machine moves the fit by a bounded amount, while a machine
that stays slower is followed within a few dozen steps. Coefficients are
kept >= 0 (a step cannot get cheaper by holding more).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from shared.step_metrics import STEP_COST_TERMS

STEP_MEMORY = 256  # steps: the forgetting factor is 1 - 1/STEP_MEMORY
ANCHOR_WEIGHT = 8.0  # the calibration weighs as much as this many steps
CLIP_FACTOR = 2.0
MIN_SECONDS = 1e-6  # a step's time is weighed by 1 / seconds^2: no zero
MAX_STALE_STEPS = 8  # steps observed before the fit is solved again though nothing read it


@dataclass(slots=True)
class StepShape:
    """What one step holds, in the cost model's terms."""

    num_tokens: int = 0
    num_samples: int = 0
    prefill_pairs: int = 0
    decode_pairs: int = 0

    def add(self, num_new_tokens: int, num_context_tokens: int, is_sampling: bool) -> None:
        """Count one sequence's part of the step: `num_new_tokens` after `num_context_tokens` already in the cache."""
        self.num_tokens += num_new_tokens
        self.num_samples += is_sampling
        if num_new_tokens == 1:
            self.decode_pairs += num_context_tokens + 1
        else:
            self.prefill_pairs += chunk_pairs(num_new_tokens, num_context_tokens)

    @classmethod
    def of_decodes(cls, num_decodes: int, num_context_tokens: int) -> StepShape:
        """`num_decodes` one-token decodes after `num_context_tokens` cached tokens between them."""
        return cls(num_decodes, num_decodes, 0, num_context_tokens + num_decodes)

    @property
    def terms(self) -> tuple[float, ...]:
        """The step's amount of each term of STEP_COST_TERMS, in order."""
        return (1.0, self.num_tokens, self.num_samples, self.prefill_pairs, self.decode_pairs)


def chunk_pairs(num_new_tokens: int, num_context_tokens: int) -> int:
    """(query, key) pairs of a causal chunk: token i of n attends to the context and i tokens of the chunk."""
    return num_new_tokens * num_context_tokens + num_new_tokens * (num_new_tokens + 1) // 2


class StepCostModel:
    """The fit, in plain Python on its five terms: it is read and taught once a step, right after the forward
    pass has left the caches cold, where a numpy call costs ten times what it does warm (0.3 ms a step for the
    numpy version of these few multiplications, measured in the worker)."""

    def __init__(self) -> None:
        size = len(STEP_COST_TERMS)
        self._coefficients: list[float] = [0.0] * size  # seconds per unit of each term, as of the last solve
        self._num_unsolved = 0  # steps observed since the last solve
        self._anchor_gram, self._anchor_moment = _zeros(size), [0.0] * size  # the calibration's sums
        self._gram, self._moment = _zeros(size), [0.0] * size  # sums of w x x^T and w x y, decayed
        self._forget = 1.0 - 1.0 / STEP_MEMORY
        self._free_terms: list[int] | None = None  # the terms the last fit left free (> 0), where the next starts

    @property
    def coefficients(self) -> list[float]:
        """Seconds per unit of each term of STEP_COST_TERMS, fitted to every step observed so far."""
        if self._num_unsolved:
            self._refit()
        return self._coefficients

    @coefficients.setter
    def coefficients(self, values: list[float]) -> None:
        """Predict with these until the next solve (a machine of known costs, in the tests)."""
        self._coefficients, self._num_unsolved = list(values), 0

    @property
    def is_fitted(self) -> bool:
        return any(self._coefficients)

    def as_dict(self) -> dict[str, float]:
        """The coefficients by term, as of the last solve (the worker's stats carry them)."""
        return dict(zip(STEP_COST_TERMS, map(float, self._coefficients)))

    def predict(self, shape: StepShape) -> float:
        return float(sum(c * x for c, x in zip(self.coefficients, shape.terms)))

    def calibrate(self, observations: list[tuple[StepShape, float]]) -> None:
        """Start from measured steps of varied shapes, which anchor the fit as ANCHOR_WEIGHT steps would.

        With none (an engine too small for every calibration shape), the fit starts from its first steps."""
        if not observations:
            return
        scale = ANCHOR_WEIGHT / len(observations)
        gram, moment = _zeros(len(self._coefficients)), [0.0] * len(self._coefficients)
        for shape, seconds in observations:
            _add_observation(gram, moment, shape.terms, seconds, 1.0, scale)
        self._anchor_gram, self._anchor_moment = gram, moment
        self._refit()

    def observe(self, shape: StepShape, seconds: float) -> float | None:
        """Learn from one step that took `seconds`. Returns what the fit predicted for it (None before the first
        fit), from a solve at most MAX_STALE_STEPS steps old."""
        terms = shape.terms
        predicted = None
        if self.is_fitted:
            predicted = float(sum(c * x for c, x in zip(self._coefficients, terms)))
            seconds = min(max(seconds, predicted / CLIP_FACTOR), predicted * CLIP_FACTOR)
        _add_observation(self._gram, self._moment, terms, seconds, self._forget, 1.0)
        self._num_unsolved += 1
        if self._num_unsolved >= MAX_STALE_STEPS or not self.is_fitted:
            self._refit()
        return predicted

    def max_chunk(self, seconds: float, num_context_tokens: int, num_wanted: int) -> int:
        """The most prefill tokens, up to num_wanted, whose chunk after num_context_tokens costs at most `seconds`."""
        if seconds <= 0:
            return 0
        _, token, _, prefill_pair, _ = self.coefficients
        linear = token + prefill_pair * (num_context_tokens + 0.5)  # cost of n: linear n + prefill_pair n^2 / 2
        if prefill_pair > 0:
            num = (-linear + math.sqrt(linear * linear + 2 * prefill_pair * seconds)) / prefill_pair
        else:
            num = seconds / linear if linear > 0 else num_wanted
        num = min(int(num), num_wanted)
        # A one-token chunk costs as a decode, and the whole rest samples: the estimate can be a token or two over.
        while num > 0 and self.chunk_seconds(num, num_context_tokens, num == num_wanted) > seconds:
            num -= 1
        return max(num, 0)

    def chunk_seconds(self, num_new_tokens: int, num_context_tokens: int, is_sampling: bool) -> float:
        """What adding one sequence's chunk to a step costs."""
        shape = StepShape()
        shape.add(num_new_tokens, num_context_tokens, is_sampling)
        return self.predict(shape) - float(self.coefficients[0])

    def _refit(self) -> None:
        gram = [[a + b for a, b in zip(anchor, row)] for anchor, row in zip(self._anchor_gram, self._gram)]
        moment = [a + b for a, b in zip(self._anchor_moment, self._moment)]
        self._coefficients, self._free_terms = _nonnegative_least_squares(gram, moment, self._free_terms)
        self._num_unsolved = 0


def _zeros(size: int) -> list[list[float]]:
    return [[0.0] * size for _ in range(size)]


def _add_observation(gram: list[list[float]], moment: list[float], terms: tuple[float, ...], seconds: float,
                     decay: float, weight: float) -> None:
    """gram = decay gram + weight w x x^T and moment = decay moment + weight w x y, in place, with w = 1 / y^2:
    each step's error counts relative to its time."""
    seconds = max(seconds, MIN_SECONDS)
    w = weight / seconds**2
    for row, x_i in zip(gram, terms):
        wx_i = w * x_i
        for j, x_j in enumerate(terms):
            row[j] = decay * row[j] + wx_i * x_j
    for i, x_i in enumerate(terms):
        moment[i] = decay * moment[i] + w * x_i * seconds


def _nonnegative_least_squares(gram: list[list[float]], moment: list[float], start: list[int] | None = None
                               ) -> tuple[list[float], list[int]]:
    """argmin over c >= 0 of the weighted squared error whose normal equations are gram c = moment, and the terms
    it leaves free (the rest are 0).

    Terms no observation has exercised stay at 0. The fit first tries the
    free terms of `start` (the last fit's: from one step to the next they
    rarely change): it stands if every coefficient comes out >= 0 and no
    term held at 0 would lower the error by growing, which makes it the
    optimum. Otherwise it starts from every exercised term, and a term whose
    coefficient comes out negative is dropped and the rest refitted (an
    active set, enough for five terms).
    """
    exercised = [i for i in range(len(moment)) if gram[i][i] > 0]
    if start is not None and set(start) <= set(exercised):
        coefficients = _fit_terms(gram, moment, start)
        if coefficients is not None and _is_optimal(gram, moment, coefficients, start, exercised):
            return coefficients, start
    active = exercised
    while active:
        solution = _solve_scaled(gram, moment, active)
        if min(solution) >= 0:
            return _spread(solution, active, len(moment)), active
        del active[solution.index(min(solution))]
    return [0.0] * len(moment), []


def _solve_scaled(gram: list[list[float]], moment: list[float], terms: list[int]) -> list[float]:
    """The least-squares coefficients of `terms` alone (the others 0), solved in units where every term weighs
    alike, with a light ridge."""
    scale = [math.sqrt(gram[i][i]) for i in terms]
    matrix = [[gram[i][j] / (si * sj) + (1e-9 if i == j else 0.0) for j, sj in zip(terms, scale)]
              for i, si in zip(terms, scale)]
    rhs = [moment[i] / si for i, si in zip(terms, scale)]
    return [x / si for x, si in zip(_solve_positive_definite(matrix, rhs), scale)]


def _fit_terms(gram: list[list[float]], moment: list[float], terms: list[int]) -> list[float] | None:
    """The coefficients of a fit of `terms` alone, or None if one of them comes out negative."""
    solution = _solve_scaled(gram, moment, terms) if terms else []
    return None if solution and min(solution) < 0 else _spread(solution, terms, len(moment))


def _spread(solution: list[float], terms: list[int], size: int) -> list[float]:
    coefficients = [0.0] * size
    for i, x in zip(terms, solution):
        coefficients[i] = x
    return coefficients


def _is_optimal(gram: list[list[float]], moment: list[float], coefficients: list[float], free: list[int],
                exercised: list[int]) -> bool:
    """Whether no exercised term held at 0 would lower the error by growing: its gradient, moment - gram c, is
    not above 0 (to a millionth of its moment, which is rounding)."""
    return all(moment[i] - sum(g * c for g, c in zip(gram[i], coefficients)) <= 1e-6 * abs(moment[i])
               for i in exercised if i not in free)


def _solve_positive_definite(matrix: list[list[float]], rhs: list[float]) -> list[float]:
    """x with matrix x = rhs, for a symmetric positive definite matrix (a Gram matrix with its ridge): by its
    Cholesky factor L (matrix = L L^T), which needs no pivoting, then two triangular solves: a few dozen
    multiplications in plain Python, a third of the time of Gaussian elimination with its pivot search."""
    size = len(rhs)
    lower = [[0.0] * size for _ in range(size)]
    for i in range(size):
        row_i, matrix_i = lower[i], matrix[i]
        for j in range(i + 1):
            row_j = lower[j]
            total = matrix_i[j]
            for k in range(j):
                total -= row_i[k] * row_j[k]
            row_i[j] = math.sqrt(max(total, 1e-300)) if i == j else total / row_j[j]  # the ridge keeps total > 0
    forward = [0.0] * size
    for i in range(size):
        row_i, total = lower[i], rhs[i]
        for k in range(i):
            total -= row_i[k] * forward[k]
        forward[i] = total / row_i[i]
    solution = [0.0] * size
    for i in reversed(range(size)):
        total = forward[i]
        for k in range(i + 1, size):
            total -= lower[k][i] * solution[k]
        solution[i] = total / lower[i][i]
    return solution
