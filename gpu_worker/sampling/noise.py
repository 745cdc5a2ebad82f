"""Counter-based noise: the random numbers of a draw, as a pure function of a key.

A request's k-th draw must not depend on how many draws came before it, on
which other requests share its batch, or on the device: a request resumed
after a worker restart has to draw the same tokens again. So there is no
generator whose state advances. Each draw gets a 64-bit key, SplitMix64-mixed
from (seed, output_index) on the host, and the noise for token v is a hash of
(key, v): the 32-bit Weyl sequence (v + 1) * gamma offset by the key's low
half, through the `lowbias32` integer hash, xor the key's high half, through
`lowbias32` again (a hash from Chris Wellons' hash-prospector search, chosen
for its low avalanche bias).

Why this and not a torch.Generator per row: the hash is int32 arithmetic
(multiplication wraps modulo 2**32 on every torch device), so the random bits
are identical on the CPU and on CUDA while being computed where the logits
already are, for all rows at once: no Python loop of per-row generators and
no [num_seqs, vocab] host-to-device copy each step. int32 rather than int64
because int64 tensor arithmetic is tens of times slower on the CPU. Only the
float transform of the bits (a log) may differ by an ulp between devices,
which matters no more than the logits themselves differing there.

`exponential_noise` is the fast path; `token_bits` is the plain Python
reference it is tested against.
"""

from __future__ import annotations

import functools

import torch

_MASK32 = (1 << 32) - 1
_MASK64 = (1 << 64) - 1
_GOLDEN_GAMMA_64 = 0x9E3779B97F4A7C15  # SplitMix64's Weyl increment
_GOLDEN_GAMMA_32 = 0x9E3779B9
_SPLITMIX_MULTIPLIERS = (0xBF58476D1CE4E5B9, 0x94D049BB133111EB)
_LOWBIAS32_MULTIPLIERS = (0x7FEB352D, 0x846CA68B)
_UNIFORM_BITS = 23  # float32 holds (bits + 0.5) / 2**23 exactly, so u lies strictly inside (0, 1)


def draw_key(seed: int, output_index: int) -> int:
    """The 64-bit key of a request's draw number `output_index`; any Python int seed is folded to 64 bits."""
    return _splitmix64(_mixed_seed(seed) + (output_index + 1) * _GOLDEN_GAMMA_64)


@functools.lru_cache(maxsize=4096)
def _mixed_seed(seed: int) -> int:
    """A request's seed through SplitMix64, the same for each of its draws: kept for the requests running."""
    return _splitmix64(seed)


def token_bits(key: int, token_id: int) -> int:
    """Reference for one element of the noise: the 32 random bits of token `token_id` under `key`."""
    weyl = ((token_id + 1) * _GOLDEN_GAMMA_32 + key) & _MASK32
    return _lowbias32(_lowbias32(weyl) ^ (key >> 32))


def exponential_noise(keys: list[int], vocab_size: int, device: torch.device) -> torch.Tensor:
    """Exp(1) noise, [len(keys), vocab_size] float32, element (r, v) a pure function of (keys[r], v)."""
    key_low = _int32_tensor([key & _MASK32 for key in keys], device)[:, None]  # [num_rows, 1]
    key_high = _int32_tensor([(key >> 32) & _MASK32 for key in keys], device)[:, None]  # [num_rows, 1]
    weyl = torch.arange(1, vocab_size + 1, dtype=torch.int32, device=device) * _as_int32(_GOLDEN_GAMMA_32)  # [vocab]
    bits = _lowbias32_(_lowbias32_(weyl + key_low).bitwise_xor_(key_high))  # [num_rows, vocab], wraps mod 2**32
    uniform = _shift_right(bits, 32 - _UNIFORM_BITS).to(torch.float32)  # [num_rows, vocab] in [0, 2**23)
    uniform.add_(0.5).mul_(2.0 ** -_UNIFORM_BITS)  # [num_rows, vocab] in (0, 1)
    return uniform.log_().neg_()  # [num_rows, vocab] > 0


def _splitmix64(z: int) -> int:
    """SplitMix64's finaliser: a bijection on 64-bit integers that spreads every input bit."""
    z &= _MASK64
    for shift, multiplier in zip((30, 27), _SPLITMIX_MULTIPLIERS):
        z = ((z ^ (z >> shift)) * multiplier) & _MASK64
    return z ^ (z >> 31)


def _lowbias32(x: int) -> int:
    x = ((x ^ (x >> 16)) * _LOWBIAS32_MULTIPLIERS[0]) & _MASK32
    x = ((x ^ (x >> 15)) * _LOWBIAS32_MULTIPLIERS[1]) & _MASK32
    return x ^ (x >> 16)


def _lowbias32_(x: torch.Tensor) -> torch.Tensor:
    """_lowbias32 over an int32 tensor of bit patterns, in place."""
    x.bitwise_xor_(_shift_right(x, 16)).mul_(_as_int32(_LOWBIAS32_MULTIPLIERS[0]))
    x.bitwise_xor_(_shift_right(x, 15)).mul_(_as_int32(_LOWBIAS32_MULTIPLIERS[1]))
    return x.bitwise_xor_(_shift_right(x, 16))


def _shift_right(x: torch.Tensor, shift: int) -> torch.Tensor:
    """Logical right shift of int32 bit patterns (torch's >> copies the sign bit)."""
    return (x >> shift).bitwise_and_((1 << (32 - shift)) - 1)


def _int32_tensor(values: list[int], device: torch.device) -> torch.Tensor:
    return torch.tensor([_as_int32(value) for value in values], dtype=torch.int32, device=device)


def _as_int32(value: int) -> int:
    """The signed int32 with the same 32-bit pattern as `value`."""
    value &= _MASK32
    return value - (1 << 32) if value >= 1 << 31 else value
