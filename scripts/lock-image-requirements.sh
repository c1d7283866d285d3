#!/usr/bin/env bash
# Regenerate deploy/docker/requirements.txt: every Python package the image installs besides
# torch and the project, pinned. Resolves in a throwaway venv with the CPU torch (same
# dependencies as the CUDA build but the nvidia-* wheels, which torch pins itself), the
# project with its [video] extra (PyAV), diffusers (modalmesh.testing.tiny's VAE: the [demo] extra) and the
# build tools, constrained to the versions of the current lock where they still fit.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
VENV=$(mktemp -d /tmp/modalmesh-lock.XXXXXX)
trap 'rm -rf "$VENV"' EXIT
"$PY" -m venv "$VENV"
"$VENV/bin/pip" install -q "pip==26.3"
"$VENV/bin/pip" install -q "torch==2.13.0"
"$VENV/bin/pip" install -q -c deploy/docker/requirements.txt setuptools wheel \
    "transformers==5.24.0" "tokenizers==0.23.3" "diffusers==0.42.1"
"$VENV/bin/pip" install -q --no-build-isolation -c deploy/docker/requirements.txt ".[video]"
{
    sed -n '/^#/p' deploy/docker/requirements.txt
    "$VENV/bin/pip" freeze --all | grep -v -E '^(modalmesh|torch|pip)( @|==)' | LC_ALL=C sort -f
} >deploy/docker/requirements.txt.new
mv deploy/docker/requirements.txt.new deploy/docker/requirements.txt
echo "deploy/docker/requirements.txt: $(grep -vc '^#' deploy/docker/requirements.txt) pins"
