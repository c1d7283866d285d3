# syntax=docker/dockerfile:1
# modalmesh: one image for all four services.
#
#   docker build -t modalmesh .                     # GPU: Debian + PyPI's torch (a CUDA build)
#   docker build -t modalmesh:cpu \                  # CPU-only, as CI builds it (scripts/compose-ci.sh)
#       --build-arg BASE_IMAGE=modalmesh-base:bookworm \
#       --build-arg TORCH_SPEC=torch==2.13.0+cpu --build-arg PIP_EXTRA_ARGS=--no-index .
#
# Run one service per container:  python -m services.<audio_encoder|vision_encoder|llm|vae>
# (flags or MODALMESH_* environment variables; gRPC on 50051, metrics on 9400), whose health
# probe is `modalmesh health`, or the OpenAI-compatible front, python -m services.gateway (:8000).
#
# Builds with the classic builder (DOCKER_BUILDKIT=0) as well as BuildKit. Wheels put in
# deploy/docker/wheels/ and CA certificates (*.crt) in deploy/docker/ca-certificates/ are used
# by the build (both folders are git-ignored); with PIP_EXTRA_ARGS=--no-index the build
# needs no Python package index at all.

# Any Debian 12 root: the official image (pinned by its dated tag) or a local debootstrap one.
ARG BASE_IMAGE=debian:bookworm-20250520-slim

FROM ${BASE_IMAGE} AS system
LABEL org.opencontainers.image.title=modalmesh \
      org.opencontainers.image.description="modalmesh services: audio/vision encoders, LLM, VAE, gateway" \
      io.modalmesh.image=1
ENV LANG=C.UTF-8 \
    DEBIAN_FRONTEND=noninteractive \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1
# Python 3.11 from Debian; every package pinned (bookworm's current point release). A Debian mirror
# keeps only the newest security build of a package, so when a pinned build leaves it the pins can no
# longer install: then the current builds are installed and the log says loudly to move the pins
# (the ARG below), rather than turning every build red overnight.
ARG APT_PINS="ca-certificates=20250419~deb12u2 python3.11=3.11.2-6+deb12u9 libpython3.11-stdlib=3.11.2-6+deb12u9 \
python3.11-venv=3.11.2-6+deb12u9 python3=3.11.2-1+b1 python3-venv=3.11.2-1+b1 python3-pip=23.0.1+dfsg-1"
RUN apt-get update \
    && if ! apt-get install -y --no-install-recommends ${APT_PINS}; then \
        echo "WARNING: pinned Debian builds are gone from the mirror; installing the current ones. Move the pins:" \
        && apt-get install -y --no-install-recommends $(echo ${APT_PINS} | sed 's/=[^ ]*//g') \
        && dpkg-query -W $(echo ${APT_PINS} | sed "s/=[^ ]*//g"); \
    fi \
    && rm -rf /var/lib/apt/lists/*
# Extra CA certificates (e.g. a proxy's): trusted by pip here and by the services at run time.
COPY deploy/docker/ca-certificates/ /usr/local/share/ca-certificates/
RUN update-ca-certificates >/dev/null
ENV SSL_CERT_FILE=/etc/ssl/certs/ca-certificates.crt \
    PIP_CERT=/etc/ssl/certs/ca-certificates.crt \
    REQUESTS_CA_BUNDLE=/etc/ssl/certs/ca-certificates.crt

# ---- dependencies: one layer that changes only with the lock, torch or the wheels
FROM system AS deps
# torch: PyPI's Linux build (CUDA) by default; CI passes torch==2.13.0+cpu from the local wheelhouse.
ARG TORCH_SPEC=torch==2.13.0
# e.g. https://download.pytorch.org/whl/cpu or .../cu128; empty: PyPI only.
ARG TORCH_INDEX_URL=
# e.g. --no-index when deploy/docker/wheels/ holds every wheel (CI: no index needed).
ARG PIP_EXTRA_ARGS=
COPY deploy/docker/requirements.txt /tmp/requirements.txt
COPY deploy/docker/wheels/ /tmp/wheels/
RUN python3 -m venv /opt/modalmesh \
    && /opt/modalmesh/bin/pip install -q --find-links /tmp/wheels ${PIP_EXTRA_ARGS} "pip==26.3" \
    && /opt/modalmesh/bin/pip install -q --find-links /tmp/wheels ${PIP_EXTRA_ARGS} \
        ${TORCH_INDEX_URL:+--extra-index-url "$TORCH_INDEX_URL"} \
        -r /tmp/requirements.txt "${TORCH_SPEC}" \
    && /opt/modalmesh/bin/python -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"

# ---- the project (its gRPC stubs are committed in modalmesh/v1/: the build generates nothing)
FROM deps AS wheel
COPY pyproject.toml README.md /src/
COPY proto/ /src/proto/
COPY modalmesh/ /src/modalmesh/
COPY services/ /src/services/
RUN /opt/modalmesh/bin/pip wheel -q --no-deps --no-build-isolation -w /dist /src

# ---- runtime: the dependency venv (cached) plus the small project wheel
FROM system AS runtime
COPY --from=deps /opt/modalmesh /opt/modalmesh
COPY --from=wheel /dist/ /tmp/dist/
RUN /opt/modalmesh/bin/pip install -q --no-deps --no-index /tmp/dist/*.whl \
    && rm -rf /tmp/dist \
    && /opt/modalmesh/bin/python -c "from modalmesh import pb; print('stubs', pb.LLM_SERVICE)" \
    && useradd --uid 10001 --create-home --shell /usr/sbin/nologin modalmesh \
    && mkdir -p /models /var/cache/modalmesh \
    && chown modalmesh:modalmesh /models /var/cache/modalmesh
ENV PATH=/opt/modalmesh/bin:$PATH \
    NVIDIA_VISIBLE_DEVICES=all \
    NVIDIA_DRIVER_CAPABILITIES=compute,utility
USER modalmesh
WORKDIR /home/modalmesh
EXPOSE 50051 8000 9400
HEALTHCHECK --interval=10s --timeout=10s --start-period=300s --retries=3 \
    CMD ["modalmesh", "health", "--target", "127.0.0.1:50051"]
CMD ["modalmesh", "--help"]
