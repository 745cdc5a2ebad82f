"""The facts the frontend and the worker agree on beyond the shape of messages (protocol.py).

Each is defined here and nowhere else; a test greps the tree for other
definitions. What crosses the wire as a string (a finish reason) is spelled
by the enum on both sides, so a new reason is added in one place.
"""

from __future__ import annotations

import enum


class FinishReason(str, enum.Enum):
    """Why a request's sequence stopped; the first two are OpenAI's, the others the server's own."""

    STOP = "stop"  # EOS, a stop token or a stop string
    LENGTH = "length"  # max_tokens, or the model's context, reached
    ABORT = "abort"  # the client went away or the request was cancelled (vLLM's word for it)
    ERROR = "error"  # its step raised for it alone: the worker fails the request and carries on


# The tokenizer (the checkpoint's, or --tokenizer's: EngineConfig.tokenizer_dir): the frontend tokenizes with it,
# the worker matches structured output's grammars against it (and its offline runner decodes with it).
TOKENIZER_FILE = "tokenizer.json"

SEED_BITS = 63  # seeds are in [0, 2**SEED_BITS): the frontend reduces a client's seed into that range

# The worker sends a message (Outputs or a Heartbeat) at least every HEARTBEAT_INTERVAL_S while it is
# between steps; one step runs without a break, so a hung step is a silence. The frontend must not call
# a worker hung for a silence that a live, idle worker can produce: its hang timeout is at least
# HEARTBEAT_MISSES_TOLERATED heartbeats.
HEARTBEAT_INTERVAL_S = 0.25
HEARTBEAT_MISSES_TOLERATED = 4

# An Outputs carries the worker's EngineStats when a request started or finished in its step, or the running or
# waiting count changed, else at most every STATS_INTERVAL_S: they are for /metrics and the supervisor, and parsing
# them with every step cost the frontend more than the step's tokens did.
STATS_INTERVAL_S = 0.1
MIN_HANG_TIMEOUT_S = HEARTBEAT_INTERVAL_S * HEARTBEAT_MISSES_TOLERATED
