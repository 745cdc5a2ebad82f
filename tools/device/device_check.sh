#!/usr/bin/env bash
# The device check (tools/device/device_check.py): on a CUDA machine, install the wheels carried in .whl/ (made by
# python -m tools.device.device_wheels), run the CUDA tests and the benchmarks, and print one table; --cpu is the
# same run, small, on the CPU. Full logs and summary.txt go to OUTDIR.
#
#   tools/device/device_check.sh OUTDIR
#   tools/device/device_check.sh --cpu OUTDIR
#   tools/device/device_check.sh --budget-s 300 OUTDIR   # a shorter run: the parts past the budget are skipped
#   tools/device/device_check.sh --skip-tests OUTDIR     # the measurements only, where the tests already passed
#
# PYTHON picks the interpreter (default: python3, the one that holds torch).
set -euo pipefail
if [ $# -lt 1 ] || [ "${1:-}" = "-h" ] || [ "${1:-}" = "--help" ]; then
    echo "usage: tools/device/device_check.sh [--cpu] [--budget-s SECONDS] [--skip-tests] OUTDIR" >&2
    exit 2
fi
cd "$(dirname "$0")/../.."
exec "${PYTHON:-python3}" -m tools.device.device_check "$@"
