#!/usr/bin/env bash
# Builds the GPU image (the Dockerfile with ENGINES=gpu: vLLM 0.26.0, verl 0.9.1, torch 2.11.0 CUDA 13.0,
# transformers 5.17.0, PEFT 0.21.2; docker/requirements-gpu.txt) through scripts/docker-build.sh, which
# brings the base images and the CA bundle secret. No GPU is needed to build it.
#
# Usage: scripts/docker-build-gpu.sh [TAG]   (default tinker-broker:gpu, the image docker-compose.yml's
#                                             GPU agents use)
#        scripts/docker-build-gpu.sh --lock  rewrites docker/constraints-gpu.txt: pip's resolution of
#                                             docker/requirements-gpu.txt for CPython 3.11 (the image's
#                                             Python), manylinux x86_64; downloads the wheels (~5 GB, pip's cache)
set -euo pipefail
cd "$(dirname "$0")/.."

if [ "${1:-}" = "--lock" ]; then
  tmp=$(mktemp -d)
  trap 'rm -rf "$tmp"' EXIT
  ca="${CA_BUNDLE:-${PIP_CERT:-${SSL_CERT_FILE:-/etc/ssl/certs/ca-certificates.crt}}}"
  pip=(python3 -m pip --isolated --cert "$ca")
  # antlr4-python3-runtime 4.9.3 (hydra-core's) exists only as an sdist; the image builds it, the lock needs a wheel.
  "${pip[@]}" wheel -q --no-deps --no-binary=:all: -w "$tmp/fl" antlr4-python3-runtime==4.9.3
  plat=(--platform manylinux2014_x86_64)
  for m in $(seq 17 36); do plat+=(--platform "manylinux_2_${m}_x86_64"); done
  "${pip[@]}" install -q --dry-run --ignore-installed --report "$tmp/report.json" --find-links "$tmp/fl" \
    --only-binary=:all: --python-version 3.11 --implementation cp "${plat[@]}" --target "$tmp/t" -r docker/requirements-gpu.txt
  {
    echo "# Every package of the GPU image's environment, as pip resolved docker/requirements-gpu.txt for"
    echo "# CPython 3.11 on manylinux x86_64 (scripts/docker-build-gpu.sh --lock). verl 0.9.1 is installed apart (--no-deps)."
    python3 -c 'import json, sys; [print(f"{i[\"metadata\"][\"name\"]}=={i[\"metadata\"][\"version\"]}") for i in json.load(open(sys.argv[1]))["install"]]' "$tmp/report.json" | sort -f
  } > docker/constraints-gpu.txt
  echo "docker-build-gpu: docker/constraints-gpu.txt: $(grep -c '==' docker/constraints-gpu.txt) packages"
  exit 0
fi

DOCKER_BUILD_ARGS="--build-arg ENGINES=gpu ${DOCKER_BUILD_ARGS:-}" exec bash scripts/docker-build.sh "${1:-tinker-broker:gpu}"
