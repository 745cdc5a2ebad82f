"""--device auto made concrete once, and the defaults of --standby-workers and --shared-kv-cache that follow from
the device (server/worker/sharing.py)."""

from __future__ import annotations

import asyncio
import logging
import sys

import pytest

from server.worker import sharing
from server.worker.sharing import available_memory, resolve_device, resolve_worker_sharing
from shared.default_model import DEFAULT_MODEL_DIR

MODEL = str(DEFAULT_MODEL_DIR)
PROBE_TIMEOUT_S = 300.0  # one import of torch on a busy machine


def resolved(device: str, timeout: float = PROBE_TIMEOUT_S) -> str:
    return asyncio.run(resolve_device(device, timeout))


def test_a_device_asked_for_by_name_is_kept(monkeypatch):
    monkeypatch.setattr(sharing, "device_probe_command", lambda: pytest.fail("no probe for a named device"))
    assert (resolved("cpu"), resolved("cuda")) == ("cpu", "cuda")


def test_auto_without_an_nvidia_device_node_is_the_cpu_without_asking_torch(monkeypatch, tmp_path):
    monkeypatch.setattr(sharing, "_NVIDIA_DEVICE", str(tmp_path / "nvidiactl"))
    monkeypatch.setattr(sharing, "device_probe_command", lambda: pytest.fail("no probe without the device node"))
    assert resolved("auto") == "cpu"


def test_auto_with_an_nvidia_device_node_is_what_the_workers_torch_sees(monkeypatch, tmp_path):
    from gpu_worker.runner.model_runner import select_device

    node = tmp_path / "nvidiactl"
    node.touch()  # a GPU machine's node; whether torch (a CPU build, say) sees a GPU is the probe's to say
    monkeypatch.setattr(sharing, "_NVIDIA_DEVICE", str(node))
    device = resolved("auto")
    assert device == select_device("auto").type
    standby, shared, _ = resolve_worker_sharing(device, MODEL, None, None, 64 << 30)
    assert (standby, shared) == ((1, True) if device == "cpu" else (0, False))


@pytest.mark.parametrize(("code", "timeout", "why"), [
    ("import sys; sys.exit('no torch here')", PROBE_TIMEOUT_S, "no torch here"),
    ("print('tpu')", PROBE_TIMEOUT_S, "exit status 0"),
    ("import time; time.sleep(60)", 0.5, "no answer within 0.5 s"),
])
def test_a_probe_that_cannot_answer_leaves_the_device_node_to_decide(monkeypatch, tmp_path, caplog, code, timeout,
                                                                    why):
    node = tmp_path / "nvidiactl"
    node.touch()
    monkeypatch.setattr(sharing, "_NVIDIA_DEVICE", str(node))
    monkeypatch.setattr(sharing, "device_probe_command", lambda: [sys.executable, "-c", code])
    with caplog.at_level(logging.WARNING, logger="pagedserve.sharing"):
        assert resolved("auto", timeout) == "cuda"
    assert why in caplog.text


def test_the_sharing_defaults_need_the_device_resolved():
    with pytest.raises(ValueError, match="resolve_device"):
        resolve_worker_sharing("auto", MODEL, None, None, 64 << 30)


def test_on_the_cpu_both_are_on_when_memory_allows():
    assert resolve_worker_sharing("cpu", MODEL, None, None, 64 << 30)[:2] == (1, True)


def test_no_standby_when_the_memory_available_would_not_hold_a_second_worker():
    standby, shared, why = resolve_worker_sharing("cpu", MODEL, None, None, 100 << 20)
    assert (standby, shared) == (0, True) and "100 MiB of memory available" in why


def test_on_cuda_neither_is_on_unless_asked():
    assert resolve_worker_sharing("cuda", MODEL, None, None, 64 << 30)[:2] == (0, False)
    assert resolve_worker_sharing("cuda", MODEL, 1, False, 64 << 30)[:2] == (1, False)


def test_what_is_asked_is_kept():
    assert resolve_worker_sharing("cpu", MODEL, 0, False, 64 << 30)[:2] == (0, False)


def test_this_machines_available_memory_is_read():
    available = available_memory()
    assert available is not None and 0 < available <= 1 << 50
