#!/usr/bin/env bash
# `make test`: the whole suite. Its compose test (tests/test_compose.py) builds the image and
# runs the real stack, so a Docker engine must answer: one is started here when none does
# (installed first on a bare Debian host), and stopped again if this script started it.
set -euo pipefail
cd "$(dirname "$0")/.."
dockerd_pid=$(scripts/ci-docker.sh start)
trap '[ -z "$dockerd_pid" ] || scripts/ci-docker.sh stop "$dockerd_pid"' EXIT
"${PY:-.venv/bin/python}" -m pytest -q "$@"
