#!/usr/bin/env bash
# A Docker engine for CI on a bare Debian host (root):
#   scripts/ci-docker.sh start   install docker.io, docker-compose (v1) and debootstrap when
#                                absent, start dockerd when no engine answers, wait for it;
#                                prints the pid to stop when this script started it
#   scripts/ci-docker.sh stop PID   stop the dockerd this script started (by its pid)
set -euo pipefail
LOG="${MODALMESH_DOCKERD_LOG:-/tmp/modalmesh-dockerd.log}"

engine_up() { docker info >/dev/null 2>&1; }

case "${1:-}" in
start)
    missing=()
    command -v dockerd >/dev/null || missing+=(docker.io)
    command -v docker-compose >/dev/null || missing+=(docker-compose)
    command -v debootstrap >/dev/null || missing+=(debootstrap)
    if [ ${#missing[@]} -gt 0 ]; then
        echo "installing ${missing[*]}" >&2
        apt-get update -q >&2
        DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "${missing[@]}" >&2
    fi
    if engine_up; then
        echo "docker engine already running" >&2
        exit 0
    fi
    dockerd >"$LOG" 2>&1 &
    pid=$!
    for _ in $(seq 1 60); do
        if engine_up; then
            echo "dockerd started (pid $pid, log $LOG): $(docker version --format 'engine {{.Server.Version}}')," \
                "$(docker-compose version --short 2>/dev/null | sed 's/^/compose /')" >&2
            echo "$pid"
            exit 0
        fi
        kill -0 "$pid" 2>/dev/null || break
        sleep 1
    done
    echo "dockerd did not come up; its log:" >&2
    tail -40 "$LOG" >&2
    kill "$pid" 2>/dev/null || true
    exit 1
    ;;
stop)
    pid="${2:?pid}"
    kill "$pid" 2>/dev/null || exit 0
    for _ in $(seq 1 30); do
        kill -0 "$pid" 2>/dev/null || exit 0
        sleep 1
    done
    echo "dockerd (pid $pid) did not stop in 30 s" >&2
    ;;
*)
    echo "usage: $0 start | stop PID" >&2
    exit 2
    ;;
esac
