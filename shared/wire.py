"""Building blocks of the wire protocol (shared/protocol.py): array frames and header field checks.

Arrays travel as raw little-endian buffers: token ids as int32, logprobs as
float32. On the receiving side `frames_as_arrays` wraps each frame's memory
with np.frombuffer, so the arrays are views of what ZMQ received, not copies.
Checks raise ValueError naming the field and the value; the codec turns them
into ProtocolError.
"""

from __future__ import annotations

import math
from typing import TypeVar

import numpy as np

from shared.logprobs import TokenLogprobs

TOKEN_DTYPE = np.dtype("<i4")
LOGPROB_DTYPE = np.dtype("<f4")
BLOCK_ID_DTYPE = np.dtype("<i4")  # KV cache block ids
BLOCK_SERIAL_DTYPE = np.dtype("<i8")  # the allocation serial of each (shared/kv_hold.py)
_MAX_TOKEN_ID = np.iinfo(TOKEN_DTYPE).max

_T = TypeVar("_T")


def empty_token_ids() -> np.ndarray:
    return np.empty(0, dtype=TOKEN_DTYPE)


def as_token_ids(name: str, value: object) -> np.ndarray:
    """A list or array of token ids -> a 1-D int32 array (no copy when it already is one)."""
    if isinstance(value, list) and all(type(t) is int and 0 <= t <= _MAX_TOKEN_ID for t in value):
        return np.array(value, dtype=TOKEN_DTYPE)  # the common case, a step's one or few new tokens: kept cheap
    if isinstance(value, np.ndarray) and value.dtype == TOKEN_DTYPE and value.ndim == 1:
        # A decoded update's one new token is read as it is: a reduction costs ten times as much.
        lowest = int(value[0]) if value.size == 1 else value.min() if value.size else 0
        if lowest < 0:
            raise ValueError(f"{name} must be token ids >= 0, got {lowest}")
        return value
    array = np.asarray(value)
    if array.size == 0 and array.ndim == 1:
        return array.astype(TOKEN_DTYPE, copy=False)
    if array.ndim != 1 or array.dtype.kind not in "iu":
        raise ValueError(f"{name} must be a 1-D sequence of integer token ids, got {array.dtype} of shape "
                         f"{array.shape}")
    if array.min() < 0 or array.max() > _MAX_TOKEN_ID:
        raise ValueError(f"{name} must be token ids in [0, {_MAX_TOKEN_ID}], got values from {array.min()} "
                         f"to {array.max()}")
    return array.astype(TOKEN_DTYPE, copy=False)


def frames_as_arrays(kind: str, frames: list[memoryview], dtypes: tuple[np.dtype, ...]) -> list[np.ndarray]:
    """One 1-D array per frame, viewing the frame's memory; the message must have exactly len(dtypes) frames."""
    if len(frames) != len(dtypes):
        raise ValueError(f"a {kind} message has {len(dtypes)} array frame(s) after its header, got {len(frames)}")
    arrays = []
    for index, (frame, dtype) in enumerate(zip(frames, dtypes)):
        if frame.nbytes % dtype.itemsize:
            raise ValueError(f"array frame {index + 1} must hold whole {dtype.name} values, got {frame.nbytes} bytes")
        arrays.append(np.frombuffer(frame, dtype=dtype))
    return arrays


def split_by_counts(array: np.ndarray, counts: list) -> list[np.ndarray]:
    """Consecutive views of `array`, one per count; the counts must cover it exactly."""
    for count in counts:
        check_int("num_new_tokens[]", count)
    if sum(counts) != len(array):
        raise ValueError(f"num_new_tokens add up to {sum(counts)} but the token frame holds {len(array)} ids")
    bounds = np.cumsum([0, *counts]).tolist()
    return [array[start:end] for start, end in zip(bounds[:-1], bounds[1:])]


def pack_logprobs(per_request: list[list[TokenLogprobs] | None]) -> list[np.ndarray]:
    """Three arrays over every token of the requests that asked: its logprob, then its top ids and top logprobs
    (k per token, k fixed per request). None of them asked: no arrays."""
    if all(entries is None for entries in per_request):
        return []
    tokens = [lp for entries in per_request if entries for lp in entries]
    return [np.array([lp.logprob for lp in tokens], dtype=LOGPROB_DTYPE),
            np.array([t for lp in tokens for t in lp.top_token_ids], dtype=TOKEN_DTYPE),
            np.array([x for lp in tokens for x in lp.top_logprobs], dtype=LOGPROB_DTYPE)]


def unpack_logprobs(token_ids: list[np.ndarray], num_top: list, arrays: list[np.ndarray]
                    ) -> list[list[TokenLogprobs] | None]:
    """Inverse of pack_logprobs, given each request's new token ids and top-k (None: it did not ask)."""
    sampled, top_ids, top_logprobs = arrays
    if len(top_ids) != len(top_logprobs):
        raise ValueError(f"top id and top logprob frames must have one length, got {len(top_ids)} and "
                         f"{len(top_logprobs)}")
    result: list[list[TokenLogprobs] | None] = []
    token_index = top_index = 0
    for ids, k in zip(token_ids, num_top):
        if k is None:
            result.append(None)
            continue
        check_int("num_top_logprobs[]", k)
        if token_index + len(ids) > len(sampled) or top_index + k * len(ids) > len(top_ids):
            raise ValueError("logprob frames are shorter than the header's counts")
        entries = []
        for token_id in ids.tolist():
            entries.append(TokenLogprobs(token_id, float(sampled[token_index]),
                                         top_ids[top_index:top_index + k].tolist(),
                                         top_logprobs[top_index:top_index + k].tolist()))
            token_index, top_index = token_index + 1, top_index + k
        result.append(entries)
    if token_index != len(sampled) or top_index != len(top_ids):
        raise ValueError(f"logprob frames hold {len(sampled)} tokens and {len(top_ids)} top entries, the header "
                         f"accounts for {token_index} and {top_index}")
    return result


def pack_prompt_logprobs(per_request: list[list[TokenLogprobs] | None]) -> list[np.ndarray]:
    """Five arrays over every prompt token of the requests that carry prompt logprobs: its id, its rank, then
    pack_logprobs' three. None carry any: no arrays."""
    if all(entries is None for entries in per_request):
        return []
    tokens = [lp for entries in per_request if entries for lp in entries]
    return [np.array([lp.token_id for lp in tokens], dtype=TOKEN_DTYPE),
            np.array([lp.rank for lp in tokens], dtype=TOKEN_DTYPE), *pack_logprobs(per_request)]


def unpack_prompt_logprobs(counts: list, num_top: list, arrays: list[np.ndarray]) -> list[list[TokenLogprobs] | None]:
    """Inverse of pack_prompt_logprobs, given each request's number of prompt tokens and top-k (None: none)."""
    token_ids, ranks, *logprob_arrays = arrays
    if len(ranks) != len(token_ids):
        raise ValueError(f"prompt token id and rank frames must have one length, got {len(token_ids)} and {len(ranks)}")
    per_request = split_by_counts(token_ids, [0 if k is None else count for count, k in zip(counts, num_top)])
    result = unpack_logprobs(per_request, num_top, logprob_arrays)
    for entry, rank in zip((lp for entries in result if entries for lp in entries), ranks.tolist()):
        entry.rank = rank
    return result


def take(header: dict, name: str, kind: type[_T]) -> _T:
    """Remove and return header[name], which must be present and a `kind`."""
    if name not in header:
        raise ValueError(f"header field {name!r} is missing")
    value = header.pop(name)
    if not isinstance(value, kind):
        raise ValueError(f"header field {name!r} must be a {kind.__name__}, got {value!r:.100}")
    return value


def check_int(name: str, value: object, minimum: int | None = 0) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or (minimum is not None and value < minimum):
        expected = "an integer" if minimum is None else f"an integer >= {minimum}"
        raise ValueError(f"{name} must be {expected}, got {value!r:.100}")


def check_float(name: str, value: object, low: float, high: float) -> None:
    if (not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value)
            or not low <= value <= high):
        raise ValueError(f"{name} must be a number in [{low}, {high}], got {value!r:.100}")


def check_str(name: str, value: object, *, allow_empty: bool = False) -> None:
    if not isinstance(value, str) or not (value or allow_empty):
        expected = "a string" if allow_empty else "a non-empty string"
        raise ValueError(f"{name} must be {expected}, got {value!r:.100}")


def check_request_ids(name: str, value: object, *, allow_empty: bool) -> tuple[str, ...]:
    """A list or tuple of non-empty request id strings -> a tuple."""
    if not isinstance(value, (list, tuple)) or not (value or allow_empty):
        expected = "a list of request ids" if allow_empty else "a non-empty list of request ids"
        raise ValueError(f"{name} must be {expected}, got {value!r:.100}")
    for request_id in value:
        check_str(f"{name}[]", request_id)
    return tuple(value)
