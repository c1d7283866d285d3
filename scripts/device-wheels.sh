#!/usr/bin/env bash
# The wheels scripts/device.sh installs on the device machine (carried as .whl): what the GPU image lacks,
# or has at another version than our venv and its tests pin (the image has huggingface-hub 1.33, which
# transformers 5.24 takes). Python 3.12, x86-64 (the image's python3). About 58 MB, under the 64 MiB a call carries.
#   bash scripts/device-wheels.sh          # then carry .whl with scripts/device.sh
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qx '/.whl/' .gitignore || { echo "/.whl/ should be in .gitignore"; exit 1; }
PACKAGES=(
    grpcio==1.85.3 grpcio-health-checking==1.85.1 grpcio-reflection==1.85.1 protobuf==7.36.2
    transformers==5.24.0 diffusers==0.42.1
    soundfile==0.14.0 cffi==2.1.1 pycparser==3.12
    nvidia-nvimgcodec-cu13==0.9.0.20 nvidia-nvjpeg==13.3.2.43
    py-spy==0.4.1
)
mkdir -p .whl
python3 -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64 \
    --platform manylinux_2_5_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_31_x86_64 \
    -d .whl "${PACKAGES[@]}"
du -sh .whl; ls .whl
