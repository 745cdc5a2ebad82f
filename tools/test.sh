#!/usr/bin/env bash
# The test suite, from a fresh checkout: set up .venv, then run pytest (extra args pass through).
set -euo pipefail
cd "$(dirname "$0")/.."
tools/setup_env.sh
exec .venv/bin/python -m pytest -q "$@"
