"""The device the tests that run a model pick: $PAGEDSERVE_TEST_DEVICE, else the CPU.

tools/device/device_check.sh sets it to cuda on a GPU machine, so the same tests check the CUDA path there; unset,
they run on the CPU as CI does.

    from helpers.test_device import TEST_DEVICE
"""

from __future__ import annotations

import os

DEVICES = ("cpu", "cuda")
TEST_DEVICE = os.environ.get("PAGEDSERVE_TEST_DEVICE", "cpu")
if TEST_DEVICE not in DEVICES:
    raise ValueError(f"PAGEDSERVE_TEST_DEVICE must be one of {', '.join(DEVICES)}, got {TEST_DEVICE!r}")
