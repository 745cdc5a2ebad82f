#!/usr/bin/env bash
# The test suite, from a fresh checkout: set up .venv, then run pytest (extra args pass through).
#   tools/test.sh           the whole suite, as CI runs it: set-up, pyright, every test
#   tools/test.sh --fast    the fast lane: pytest -m "not e2e and not slow", the unit and in-process tests (no
#                           server, worker, redis-server or nginx, no other program, no whole model: the tiers of
#                           tests/conftest.py), with no set-up once .venv exists and no pyright
# The end-to-end tests run real nginx, redis-server and promtool binaries; where one is missing and this runs as
# root on Debian or Ubuntu, the distribution's package is installed (no service of its own is left running:
# the tests start their own, unprivileged, on free ports; promtool only checks and tests the alert rules).
set -euo pipefail
cd "$(dirname "$0")/.."

install_test_services() {
    local missing=() needed program package
    for needed in nginx:nginx redis-server:redis-server promtool:prometheus; do  # program:its Debian package
        program=${needed%%:*} package=${needed#*:}
        command -v "$program" >/dev/null || [ -x "/usr/sbin/$program" ] || [ -x "/usr/bin/$program" ] ||
            missing+=("$package")
    done
    [ ${#missing[@]} -eq 0 ] && return
    if [ "$(id -u)" -ne 0 ] || ! command -v apt-get >/dev/null; then
        echo "tools/test.sh: not installed: ${missing[*]}; the tests that run them will fail (promtool's skip)." \
             "Install them, e.g. sudo apt-get install ${missing[*]}" >&2
        return
    fi
    # A package's post-install would start its service (nginx on :80, redis on :6379, prometheus on :9090);
    # policy-rc.d exit status 101 forbids that, for this install only.
    local policy=/usr/sbin/policy-rc.d made_policy=""
    if [ ! -e "$policy" ]; then
        printf '#!/bin/sh\nexit 101\n' >"$policy" && chmod 755 "$policy" && made_policy=1
        trap "rm -f $policy" EXIT
    fi
    export DEBIAN_FRONTEND=noninteractive
    apt-get install -y -q --no-install-recommends "${missing[@]}" ||
        { apt-get update -q && apt-get install -y -q --no-install-recommends "${missing[@]}"; }
    if [ -n "$made_policy" ]; then
        rm -f "$policy"
        trap - EXIT
    fi
    # Where a service started anyway (a policy that allowed it), stop it.
    for package in "${missing[@]}"; do
        if command -v service >/dev/null && service "$package" status >/dev/null 2>&1; then
            service "$package" stop
        fi
    done
}

if [ "${1:-}" = "--fast" ]; then
    shift
    [ -x .venv/bin/python ] || tools/setup_env.sh
    exec .venv/bin/python -m pytest -q -m "not e2e and not slow" "$@"
fi

install_test_services
tools/setup_env.sh
# Types first ([tool.pyright] in pyproject.toml: server/, gpu_worker/, shared/ in basic mode), then the tests.
.venv/bin/pyright --pythonpath .venv/bin/python
exec .venv/bin/python -m pytest -q "$@"
