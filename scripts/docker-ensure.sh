#!/usr/bin/env bash
# Makes Docker usable on this machine for the compose test: installs Debian's docker.io (dockerd 20.10)
# and docker-compose (1.29) when the machine has neither a Docker engine nor compose, and starts dockerd
# (log: /tmp/tinker-broker-dockerd.log) when `docker info` finds no running engine. Needs root.
set -euo pipefail

need=()
command -v dockerd >/dev/null || need+=(docker.io)
if ! docker compose version >/dev/null 2>&1 && ! command -v docker-compose >/dev/null; then need+=(docker-compose); fi
if [ ${#need[@]} -gt 0 ]; then
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}" >/dev/null
fi

if ! docker info >/dev/null 2>&1; then
  nohup dockerd >/tmp/tinker-broker-dockerd.log 2>&1 &
  for _ in $(seq 60); do docker info >/dev/null 2>&1 && break; sleep 1; done
  docker info >/dev/null 2>&1 || { echo "dockerd did not start; see /tmp/tinker-broker-dockerd.log" >&2; exit 1; }
fi
echo "docker: engine $(docker version --format '{{.Server.Version}}'), compose $(docker compose version --short 2>/dev/null || docker-compose version --short)"
