#!/bin/bash
# What bench/gpu/vllm_sdk_check.sh needs on the offline H200 machine, cut into four git-ignored
# folders of the repository (.carry-a … .carry-d, each under 56 MiB so that a device call with the
# working tree stays under its 64 MiB), to be carried in four consecutive calls:
#   .carry-a  node (xz), redis-server + liblzf/libjemalloc/libatomic, the production node_modules,
#             cp312 wheels of tinker 0.38.0 and what of its needs the machine lacks, peft 0.21.2
#             (the engine's pin; the machine has 0.21.0), the first 10 MiB of the vLLM overlay
#   .carry-b  .carry-c  54 MiB of the vLLM overlay each
#   .carry-d  the rest of it and SHA256SUMS of everything
# The vLLM overlay is ../shared/reference/vllm-on-h200/build_vllm_carry.sh's (vLLM 0.26.0, FA2 dropped).
#
#   bash bench/gpu/build_vllm_sdk_carry.sh [WORKDIR=/tmp/vllm-sdk-carry]
# Steps whose output exists in WORKDIR are not run again. Runs on a networked machine (pip, npm).
set -euo pipefail
cd "$(dirname "$0")/../.."
REPO=$(pwd)
W=${1:-/tmp/vllm-sdk-carry}
mkdir -p "$W"
REF=${VLLM_CARRY_SCRIPT:-$REPO/../shared/reference/vllm-on-h200/build_vllm_carry.sh}
[ -f "$W/vbuild/vsite.tar.xz" ] || PY=${PY:-python3} bash "$REF" "$W/vbuild" --drop-fa2
bash "$REPO/bench/gpu/build_stack_carry.sh" "$W"
PLAT=(--only-binary=:all: --no-deps --python-version 3.12 --implementation cp --platform manylinux2014_x86_64)
[ -d "$W/whl/eng" ] || python3 -m pip download -q "${PLAT[@]}" -d "$W/whl/eng" peft==0.21.2

grep -q '^/.carry-\*/$' .git/info/exclude 2>/dev/null || echo '/.carry-*/' >> .git/info/exclude
rm -rf .carry-a .carry-b .carry-c .carry-d
mkdir -p .carry-a/whl .carry-b .carry-c .carry-d
V=$W/vbuild/vsite.tar.xz; M=$((1024 * 1024))
dd if="$V" of=.carry-a/vsite.tar.xz.part-0 bs=$M count=10 status=none
dd if="$V" of=.carry-b/vsite.tar.xz.part-1 bs=$M skip=10 count=54 status=none
dd if="$V" of=.carry-c/vsite.tar.xz.part-2 bs=$M skip=64 count=54 status=none
dd if="$V" of=.carry-d/vsite.tar.xz.part-3 bs=$M skip=118 status=none
cp "$W/node.xz" "$W/redis.tar.xz" "$W/nm.tar.xz" .carry-a/
cp -r "$W/whl/sdk" "$W/whl/eng" .carry-a/whl/
(cd "$W/vbuild" && sha256sum vsite.tar.xz) > .carry-d/SHA256SUMS
(cd .carry-a && sha256sum node.xz redis.tar.xz nm.tar.xz whl/sdk/* whl/eng/*) >> .carry-d/SHA256SUMS
du -sb .carry-a .carry-b .carry-c .carry-d
