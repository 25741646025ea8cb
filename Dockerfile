# One image for the API and the worker agents: Node.js 20 for the TypeScript processes, Python 3.11
# (Debian 12's) with torch + transformers + PEFT for the engine, and the tiny test model generated at
# build time (models/tiny-qwen3, for the CPU variant). Needs BuildKit (Docker 23+, or DOCKER_BUILDKIT=1
# on Docker 20.10); scripts/docker-build.sh builds it, also on machines without Docker Hub.
#
# ENGINES picks the Python engine stack (one stage each below; the rest of the image is shared):
#   torch  (default)  torch + transformers + PEFT from workers/python/requirements.txt
#   gpu               also vLLM and verl, at the versions that ran on the GPU device
#                     (docker/requirements-gpu.txt, locked by docker/constraints-gpu.txt), with the
#                     CUDA runtime from torch's nvidia-* wheels: --build-arg ENGINES=gpu, tinker-broker:gpu,
#                     built by scripts/docker-build-gpu.sh.
#
# ENGINES=torch, torch: by default the wheel from PyPI (the CUDA build). For a CPU-only image pass
#   --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
# or put a torch wheel for cp311 (e.g. torch-2.13.0+cpu-cp311-...whl) into docker/wheels/: a wheel
# there wins over both indexes. It is mounted for the install step only, never copied into the image.
#
# A machine that reaches the registries through a TLS-intercepting proxy passes its CA bundle as a
# build secret (used by npm and pip during the build, not stored in the image):
#   docker build --secret id=ca_bundle,src=/etc/ssl/certs/ca-certificates.crt .
ARG ENGINES=torch

FROM node:20-bookworm-slim AS node

# Used by engines-torch; declared here too, where it always was, so the build cache of the layers below
# (keyed on the build arguments in scope) stays valid for images built before the engine stages.
ARG TORCH_INDEX_URL=

RUN apt-get update \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends python3 python3-venv ca-certificates tini \
 && rm -rf /var/lib/apt/lists/*

WORKDIR /app

COPY package.json package-lock.json ./
RUN --mount=type=secret,id=ca_bundle \
    if [ -f /run/secrets/ca_bundle ]; then export NODE_EXTRA_CA_CERTS=/run/secrets/ca_bundle; fi \
 && npm ci --omit=dev --no-audit --no-fund \
 && npm cache clean --force

# torch + transformers + PEFT (ENGINES=torch, the default).
FROM node AS engines-torch
ARG TORCH_INDEX_URL=
COPY workers/python/requirements.txt workers/python/requirements.txt
RUN --mount=type=secret,id=ca_bundle --mount=type=bind,source=docker/wheels,target=/wheels \
    if [ -f /run/secrets/ca_bundle ]; then export PIP_CERT=/run/secrets/ca_bundle; fi \
 && python3 -m venv /app/.venv \
 && torch_req="$(grep '^torch==' workers/python/requirements.txt)" \
 && torch_whl="$(ls /wheels/torch-"${torch_req#torch==}"[+-]*cp311*.whl 2>/dev/null | head -n1)" \
 && if [ -n "$torch_whl" ]; then /app/.venv/bin/pip install --no-cache-dir "$torch_whl"; \
    elif [ -n "$TORCH_INDEX_URL" ]; then /app/.venv/bin/pip install --no-cache-dir --index-url "$TORCH_INDEX_URL" "$torch_req"; \
    fi \
 && /app/.venv/bin/pip install --no-cache-dir -r workers/python/requirements.txt \
 && /app/.venv/bin/python -c "import torch, transformers, peft; print('torch', torch.__version__, 'transformers', transformers.__version__, 'peft', peft.__version__)"

# vLLM + verl + torch (CUDA 13.0). verl 0.9.1 caps transformers below 5.11 and the engine needs 5.17+,
# so verl goes in without its dependencies (requirements-gpu-nodeps.txt; they are in requirements-gpu.txt), as on the device.
FROM node AS engines-gpu
COPY docker/requirements-gpu.txt docker/requirements-gpu-nodeps.txt docker/constraints-gpu.txt docker/
RUN --mount=type=secret,id=ca_bundle \
    if [ -f /run/secrets/ca_bundle ]; then export PIP_CERT=/run/secrets/ca_bundle; fi \
 && python3 -m venv /app/.venv \
 && /app/.venv/bin/pip install --no-cache-dir -r docker/requirements-gpu.txt -c docker/constraints-gpu.txt \
 && /app/.venv/bin/pip install --no-cache-dir --no-deps -r docker/requirements-gpu-nodeps.txt
ENV TB_VLLM_BIN=/app/.venv/bin/vllm

# The image: the chosen engine stack, the broker's sources, the tiny model.
FROM engines-${ENGINES}
COPY tsconfig.json ./
COPY scripts scripts
COPY presets presets
COPY queues queues
COPY api api
COPY workers workers
RUN /app/.venv/bin/python scripts/make_tiny_model.py --out models/tiny-qwen3 \
 && node --import tsx scripts/tinker-broker.ts validate presets/*/*.yaml

ENV NODE_ENV=production \
    TB_PYTHON=/app/.venv/bin/python \
    TB_LOG_FORMAT=json \
    TB_STORAGE_DIR=/data/storage
ENTRYPOINT ["/usr/bin/tini", "--"]
# docker-compose.yml gives each service its own `start --preset … --api-only | --agent ID` command.
CMD ["node", "--import", "tsx", "scripts/tinker-broker.ts", "start"]
