#!/usr/bin/env bash
# Builds the tinker-broker image from the Dockerfile, unchanged, on any machine with Docker:
#   - base images: node:20-bookworm-slim and redis:7-bookworm are used when present or pullable; a machine
#     without Docker Hub gets them built from Debian's packages (scripts/docker-base-image.sh).
#   - torch: a local torch wheel of the pinned version for Python 3.11 (the CPU build, say) found in
#     TORCH_WHEEL_DIRS (default: PIP_FIND_LINKS and pip's configured find-links) is linked into docker/wheels/, which the Dockerfile's
#     install step mounts; else TORCH_INDEX_URL is passed on (e.g. the PyTorch CPU index), else PyPI's torch.
#   - CA bundle: CA_BUNDLE (default: PIP_CERT, SSL_CERT_FILE, or /etc/ssl/certs/ca-certificates.crt) goes to
#     npm and pip as the build secret ca_bundle, for machines behind a TLS-intercepting proxy; it is not
#     stored in the image.
#   - BuildKit: the docker client's buildx when it has it, else a Docker 20.10-22 client with DOCKER_BUILDKIT=1.
#
# Usage: scripts/docker-build.sh [TAG]   (default tinker-broker:latest, the image docker-compose.yml names)
# Extra `docker build` arguments can be given in DOCKER_BUILD_ARGS.
set -euo pipefail
cd "$(dirname "$0")/.."
tag="${1:-tinker-broker:latest}"

# A docker client that can run BuildKit builds (RUN --mount, secrets).
client=""
for c in docker /usr/bin/docker; do
  command -v "$c" >/dev/null || continue
  if "$c" buildx version >/dev/null 2>&1; then client="$c"; break; fi
  major=$("$c" version --format '{{.Client.Version}}' 2>/dev/null | cut -d. -f1 || true)
  if [ -n "$major" ] && [ "$major" -lt 23 ] 2>/dev/null; then client="$c"; break; fi
done
if [ -z "$client" ]; then
  echo "docker-build: no docker client with BuildKit: install docker-buildx (Docker 23+) or use a Docker 20.10 client" >&2
  exit 1
fi

# Base images: present, else pulled, else built from Debian's packages.
missing=()
for img in node:20-bookworm-slim redis:7-bookworm; do
  docker image inspect "$img" >/dev/null 2>&1 && continue
  if ! timeout 120 docker pull -q "$img" >/dev/null 2>&1; then
    missing+=("$([ "$img" = redis:7-bookworm ] && echo redis || echo node)")
  fi
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "docker-build: ${missing[*]} base image(s) not pullable here; building them from Debian's packages"
  bash scripts/docker-base-image.sh "${missing[@]}"
fi

# A local torch wheel of the pinned version (Python 3.11, Linux x86_64).
torch_version="$(grep '^torch==' workers/python/requirements.txt | cut -d= -f3)"
rm -f docker/wheels/*.whl
pip_find_links="$(python3 -m pip config get global.find-links 2>/dev/null || true)"
for d in ${TORCH_WHEEL_DIRS:-${PIP_FIND_LINKS:-} $pip_find_links}; do
  d="${d#file://}"
  [ -d "$d" ] || continue
  w="$(ls "$d"/torch-"${torch_version}"[+-]*cp311*linux*x86_64*.whl 2>/dev/null | head -n1 || true)"
  if [ -n "$w" ]; then
    ln "$w" docker/wheels/ 2>/dev/null || cp "$w" docker/wheels/
    echo "docker-build: torch from $(basename "$w")"
    break
  fi
done

args=(build -t "$tag" --build-arg "TORCH_INDEX_URL=${TORCH_INDEX_URL:-}")
ca="${CA_BUNDLE:-${PIP_CERT:-${SSL_CERT_FILE:-/etc/ssl/certs/ca-certificates.crt}}}"
[ -f "$ca" ] && args+=(--secret "id=ca_bundle,src=$ca")
# shellcheck disable=SC2206
args+=(${DOCKER_BUILD_ARGS:-} .)
start=$(date +%s)
DOCKER_BUILDKIT=1 "$client" "${args[@]}"
echo "docker-build: $tag built in $(($(date +%s) - start)) s"
