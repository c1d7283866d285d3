#!/usr/bin/env bash
# Prepare a build of the CPU image on a host that reaches no container registry (CI):
#   1. the base image modalmesh-base:bookworm (debootstrap + docker import, only when missing);
#   2. deploy/docker/wheels/: every wheel the image installs, torch's CPU build included
#      (pip finds it on this host's disk), so the image builds with `pip --no-index`;
#   3. deploy/docker/ca-certificates/: this host's local CA certificates, trusted in the image.
# Both folders are git-ignored. Idempotent and quick when nothing changed.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
TORCH_SPEC="${MODALMESH_TORCH_SPEC:-torch==2.13.0+cpu}"

scripts/build-base-image.sh "${MODALMESH_BASE_IMAGE:-modalmesh-base:bookworm}"

# Wheels: download only when the lock (or torch) changed since the last run.
stamp=deploy/docker/wheels/.stamp
want="$(sha256sum deploy/docker/requirements.txt | cut -c1-64) $TORCH_SPEC"
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
    find deploy/docker/wheels -name '*.whl' -delete
    "$PY" -m pip download -q --disable-pip-version-check --only-binary=:all: --no-deps \
        -d deploy/docker/wheels -r deploy/docker/requirements.txt "$TORCH_SPEC" "pip==26.3"
    echo "$want" >"$stamp"
fi
echo "wheelhouse: $(find deploy/docker/wheels -name '*.whl' | wc -l) wheels, $(du -sh deploy/docker/wheels | cut -f1)"

# CA certificates the host trusts beyond Debian's bundle (e.g. an HTTPS proxy's).
find deploy/docker/ca-certificates -name '*.crt' -delete
if [ -d /usr/local/share/ca-certificates ]; then
    find /usr/local/share/ca-certificates -name '*.crt' -exec cp {} deploy/docker/ca-certificates/ \;
fi
echo "ca-certificates: $(find deploy/docker/ca-certificates -name '*.crt' | wc -l) extra"
