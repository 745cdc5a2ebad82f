"""Kernel calls run from C (kernel_program.c): a run of them is one ctypes call; rebound in place between steps.

Owns turning a KernelCall (a ctypes kernel and its arguments) into the
record the C side runs, and running a program of them. Knows nothing of
models: cpu_kernel_step.py lays out a step's calls and says which it binds
again each step.

Why: a ctypes call costs ~1.5 us before the kernel starts (argument
conversion, the foreign call), and a step of small kernels pays it ~10
times a layer; the C side's loop pays a switch and an indirect call.

How: the records lie in one int64 array, a record's words its signature's
index, the kernel's address and one word per argument (kernel_program.c
says how each type is held). A call whose kernel the C side cannot call
(a Python function such as oneDNN's product copied into place, a ctypes
function of another signature) stays a Python call at its place in the
program: a run of C records between such calls is one C call.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import struct
from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpu_worker.native.compiled_library import load_or_warn
from shared.cpu_tier import CpuTier

logger = logging.getLogger("pagedserve.worker.models")

SOURCE = Path(__file__).with_name("kernel_program.c")
SPELLING = {ctypes.c_void_p: "p", ctypes.c_int64: "l", ctypes.c_int: "i", ctypes.c_float: "f"}  # the C side's letters
HEADER_WORDS = 2  # a record's signature and kernel address, before its arguments

KernelCall = tuple[Callable[..., int], tuple]  # a kernel and its arguments, run as kernel(*arguments)
_FLOAT = struct.Struct("<f")
_FLOAT_BITS = struct.Struct("<I")


class KernelRefused(ValueError):
    """A call of the program returned a non-zero status: which one (its index and op name) and the status."""

    def __init__(self, index: int, op: str, status: int) -> None:
        super().__init__(f"{op}: the kernel refused its inputs, status {status}")
        self.index, self.op, self.status = index, op, status


@dataclass(slots=True, frozen=True)
class _Signature:
    index: int  # in the C side's SIGNATURES
    address: int  # the kernel's
    num_arguments: int
    floats: tuple[int, ...]  # the positions of float arguments, held as their bits


class ProgramRunner:
    """The loaded library: which kernels it can call, and running a range of a program's records."""

    def __init__(self, library: ctypes.CDLL) -> None:
        self.record_words = ctypes.c_int32.in_dll(library, "pagedserve_program_record_words").value
        self._signature_of = library.pagedserve_program_signature
        self._signature_of.argtypes, self._signature_of.restype = [ctypes.c_char_p], ctypes.c_int
        self.run = library.pagedserve_run_program  # (program, first, last, failed) -> status
        self.run.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p]
        self.run.restype = ctypes.c_int
        self._signatures: dict[int, tuple[Callable[..., int], _Signature | None]] = {}  # id -> (kernel, its signature)

    def signature(self, kernel: Callable[..., int]) -> _Signature | None:
        """How the C side calls this kernel; None where it cannot (not a ctypes function returning an int status,
        or of a signature kernel_program.c does not have)."""
        if getattr(kernel, "argtypes", None) is None:  # a Python function or method
            return None
        cached = self._signatures.get(id(kernel))
        if cached is None or cached[0] is not kernel:
            cached = self._signatures[id(kernel)] = (kernel, self._look_up(kernel))
        return cached[1]

    def _look_up(self, kernel: Any) -> _Signature | None:
        """kernel: a ctypes function (it has argtypes)."""
        argtypes = getattr(kernel, "argtypes")
        if getattr(kernel, "restype", None) is not ctypes.c_int:
            return None
        if not all(t in SPELLING for t in argtypes) or HEADER_WORDS + len(argtypes) > self.record_words:
            return None
        spelling = "".join(SPELLING[t] for t in argtypes)
        index = self._signature_of(spelling.encode())
        if index < 0:
            return None
        address = ctypes.cast(kernel, ctypes.c_void_p).value
        assert address is not None
        floats = tuple(i for i, letter in enumerate(spelling) if letter == "f")
        return _Signature(index, address, len(argtypes), floats)


class KernelProgram:
    """Named calls run in order: consecutive ones the C side can call as one C call, the others from Python.

    The tensors and ctypes objects the arguments point into must stay alive and in place while the program runs.
    """

    def __init__(self, runner: ProgramRunner, calls: Sequence[tuple[str, KernelCall]]) -> None:
        self._runner = runner
        self.ops = [op for op, _ in calls]
        self._signatures = [runner.signature(kernel) for _, (kernel, _) in calls]
        self._python_calls: list[KernelCall | None] = [None] * len(calls)
        self._words = array("q", bytes(8 * runner.record_words * len(calls)))  # never resized: its address holds
        self._address = self._words.buffer_info()[0]
        self._failed = ctypes.c_int64(-1)
        self._places: dict[str, list[int]] = {}  # each op's indices, in order
        for index, op in enumerate(self.ops):
            self._places.setdefault(op, []).append(index)
        for index, (_, call) in enumerate(calls):
            self.bind(index, call)
        # Runs of C records (first, last) and the indices of Python calls, in the program's order.
        self.segments: list[tuple[int, int] | int] = []
        for index, signature in enumerate(self._signatures):
            previous = self.segments[-1] if self.segments else None
            if signature is None:
                self.segments.append(index)
            elif isinstance(previous, tuple) and previous[1] == index:
                self.segments[-1] = (previous[0], index + 1)
            else:
                self.segments.append((index, index + 1))

    def bind(self, index: int, call: KernelCall) -> None:
        """Put `call` at `index`, in place of the call there: the same kernel, or one of its signature."""
        if self._signatures[index] is None:
            if self._runner.signature(call[0]) is not None:
                raise ValueError(f"{self.ops[index]} is a Python call in this program, got a kernel the C side calls")
            self._python_calls[index] = call
            return
        self._put(index, self._record(index, call))

    def bind_each(self, op: str, call: KernelCall, pointers_at: slice | None = None,
                  pointers: Sequence[tuple[int, ...]] = ()) -> None:
        """Put `call` at every place of `op` (a C call), in order; where pointers_at is given, with its arguments
        there replaced at the i-th place by pointers[i] (another layer's caches, say). One conversion of the
        arguments for all the places: a step binds its rotary rows, KV slots and attention metadata so."""
        places = self._places[op]
        record = self._record(places[0], call)
        if pointers_at is None:
            for index in places:
                self._put(index, record)
            return
        first, last = HEADER_WORDS + pointers_at.start, HEADER_WORDS + pointers_at.stop
        for index, replacement in zip(places, pointers, strict=True):
            record[first:last] = array("q", replacement)
            self._put(index, record)

    def _record(self, index: int, call: KernelCall) -> array:
        """The words of `call` as the record at `index` (a C call), checked to be of its signature."""
        kernel, args = call
        signature, bound = self._signatures[index], self._runner.signature(kernel)
        assert signature is not None
        if bound is None:
            raise ValueError(f"{self.ops[index]} is a C call in this program, got one the C side cannot make")
        if bound.index != signature.index or len(args) != bound.num_arguments:
            raise ValueError(f"{self.ops[index]} needs a kernel of the signature it was built with and its "
                             f"{signature.num_arguments} arguments")
        words = [0 if value is None else value for value in args]
        for position in bound.floats:
            words[position] = _FLOAT_BITS.unpack(_FLOAT.pack(words[position]))[0]
        return array("q", (bound.index, bound.address, *words))

    def _put(self, index: int, record: array) -> None:
        start = index * self._runner.record_words
        self._words[start:start + len(record)] = record

    def run(self) -> None:
        """Every call in order; a non-zero status stops the program with KernelRefused naming its call."""
        for segment in self.segments:
            if isinstance(segment, tuple):
                if status := self._runner.run(self._address, segment[0], segment[1], ctypes.byref(self._failed)):
                    raise KernelRefused(self._failed.value, self.ops[self._failed.value], status)
            else:
                kernel, args = self._python_calls[segment]  # type: ignore[misc]
                if status := kernel(*args):
                    raise KernelRefused(segment, self.ops[segment], status)


@functools.cache
def load_program_runner(tier: CpuTier | None = None) -> ProgramRunner | None:
    """The runner's build for the tier (this process's by default); None (after one warning) if none loads."""
    library = load_or_warn(SOURCE, logger, "the kernel program runner", "the model's forward pass for every step",
                           tier)
    return None if library is None else ProgramRunner(library)
