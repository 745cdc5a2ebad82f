#!/usr/bin/env bash
# Create (or reuse) .venv and install pagedserve into it with its test dependencies.
# Where no torch is installed yet, the CPU build of torch 2.13.0 goes in first, so the
# project's open requirement (torch>=2.4) does not pull a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/python ] || python3 -m venv .venv
. .venv/bin/activate
python -c "import torch" 2>/dev/null || pip install -q torch==2.13.0
pip install -q -e '.[test]'
