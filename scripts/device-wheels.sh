#!/usr/bin/env bash
# The wheels scripts/device.sh installs on the device machine (carried as .whl): what the GPU image lacks,
# or has at another version than our venv and its tests pin (the image has huggingface-hub 1.33, which
# transformers 5.24 takes). Python 3.12, x86-64 (the image's python3). A call carries at most 64 MiB, and the
# base set with both extras is about 67 MiB, so a call takes one extra:
#   bash scripts/device-wheels.sh               # base + structured (xgrammar, jsonschema: the samplers' tests), ~39 MiB
#   bash scripts/device-wheels.sh nvimgcodec    # base + nvImageCodec (issue 18's GPU JPEG decode steps), ~59 MiB
#   bash scripts/device-wheels.sh video         # base + PyAV, less diffusers (the video-cuda step), ~60 MiB
#   bash scripts/device-wheels.sh fa3           # base + the forward-only FlashAttention-3 wheel (the towers' and
#                                               # the attention bench's fa3 rows; einops, packaging are on the image)
# then carry .whl with scripts/device.sh. The image has neither xgrammar nor jsonschema (found 2026-12-05:
# tests/test_structured.py failed to import there).
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qx '/.whl/' .gitignore || { echo "/.whl/ should be in .gitignore"; exit 1; }
PACKAGES=(
    grpcio==1.85.3 grpcio-health-checking==1.85.1 grpcio-reflection==1.85.1 protobuf==7.36.2
    transformers==5.24.0 diffusers==0.42.1
    soundfile==0.14.0 cffi==2.1.1 pycparser==3.12
    py-spy==0.4.1
)
STRUCTURED=(
    xgrammar==0.2.9 apache-tvm-ffi==0.1.15.post2
    pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5
    jsonschema==4.26.0 jsonschema-specifications==2025.9.1 referencing==0.37.0 rpds-py==2026.9.1 attrs==26.1.0
)
NVIMGCODEC=(nvidia-nvimgcodec-cu13==0.9.0.20 nvidia-nvjpeg==13.3.2.43)
FA3=(fa3-fwd==0.0.3)  # stable-ABI build (aoti_torch_*): loads under the image's torch 2.11 though built for 2.10
case ${1:-structured} in
    structured) PACKAGES+=("${STRUCTURED[@]}") ;;
    nvimgcodec) PACKAGES+=("${NVIMGCODEC[@]}") ;;
    fa3) PACKAGES+=("${FA3[@]}") ;;
    video)  # PyAV's wheel is 34 MiB: diffusers (the VAE's reference) makes room
        for i in "${!PACKAGES[@]}"; do [[ ${PACKAGES[$i]} == diffusers==* ]] && unset "PACKAGES[$i]"; done
        PACKAGES+=(av==18.1.0) ;;
    *) echo "usage: $0 [structured|nvimgcodec|video|fa3]"; exit 2 ;;
esac
mkdir -p .whl
rm -f .whl/*.whl  # one set at a time: the two extras together pass what a call carries
python3 -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64 \
    --platform manylinux_2_5_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_31_x86_64 \
    -d .whl "${PACKAGES[@]}"
du -sh .whl; ls .whl
