#!/bin/bash
# bench/snapshot-cost.ts on the H200 machine (issue 32): what a snapshot after every optim_step costs
# the training loop, and how long each one holds the op stream, at Qwen3-1.7B's and Qwen3-8B's
# shapes (random-initialised, bf16, bench/gpu/engine_vs_plain.py's MODELS), LoRA rank 32, batch
# 8 x 1024 tokens, the torch engine on the GPU; the start command as a user starts it. Here, once:
#   bash bench/gpu/snapshot_cost.sh prepare   (bench/gpu/build_stack_carry.sh's node, redis-server and
#                                             production node_modules, and the engine's pinned peft
#                                             wheel, into var/carry-snapshot, git-ignored)
# then in one device call on an H200 (the 8B step peaks near 111 GiB), carrying var/carry-snapshot:
#   bash bench/gpu/snapshot_cost.sh [shape:steps,...=1.7b:20,8b:15] [rounds=2]
# Each shape: its model written to /tmp/tbs/models (kept on a warm machine), then the bench, its
# runs alternating without and with snapshots on fresh servers. About 7 minutes for the defaults.
# RANK, SEQ, BATCH, WARMUP and DEVICE (cuda) override the rest; a CPU smoke test of this script:
#   TB_PYTHON=.venv/bin/python DEVICE=cpu SEQ=32 BATCH=2 bash bench/gpu/snapshot_cost.sh tiny:5 1
set -euo pipefail
cd "$(dirname "$0")/../.."
C=var/carry-snapshot
if [ "${1:-}" = prepare ]; then
  bash bench/gpu/build_stack_carry.sh /tmp/stack-carry
  rm -rf $C && mkdir -p $C && cp /tmp/stack-carry/node.xz /tmp/stack-carry/redis.tar.xz /tmp/stack-carry/nm.tar.xz $C/
  # The engine's pinned peft (the GPU machine has another), for bench/gpu/shape_lib.sh's engine.
  python3 -m pip download -q --only-binary=:all: --no-deps --python-version 3.12 --implementation cp \
    --platform manylinux2014_x86_64 -d $C/whl "$(grep '^peft==' workers/python/requirements.txt)"
  # Liger's kernels for TB_ENGINE_KERNELS=liger (bench/gpu/kernels.sh); pure Python over Triton, which
  # the GPU machine's torch brings.
  python3 -m pip download -q --no-deps -d $C/whl "$(grep -o -m1 'liger-kernel==[0-9.]*' bench/gpu/kernels.sh)"
  du -sh $C
  exit 0
fi
SHAPES=${1:-1.7b:20,8b:15}
ROUNDS=${2:-2}
RANK=${RANK:-32} SEQ=${SEQ:-1024} BATCH=${BATCH:-8} WARMUP=${WARMUP:-3}
source bench/gpu/shape_lib.sh

for spec in ${SHAPES//,/ }; do
  shape=${spec%%:*} steps=${spec#*:}
  stamp "writing the Qwen3 $shape-shaped model"
  write_model "$shape" "$TB/models/qwen3-$shape" || { stamp "$shape: the model could not be written"; continue; }
  stamp "bench/snapshot-cost.ts: Qwen3 $shape shape on $DEVICE, rank $RANK, batch $BATCH x $SEQ, $WARMUP + $steps steps, $ROUNDS rounds"
  # TB_LOG_LEVEL=info: the engine's line per op reaches the server's log, with each snapshot_state's time.
  TB_LOG_LEVEL=info node --import tsx bench/snapshot-cost.ts "$steps" "$ROUNDS" "$RANK" "$SEQ" "$BATCH" \
    --model "$TB/models/qwen3-$shape" --device "$DEVICE" --warmup "$WARMUP" || stamp "$shape: the bench failed (exit $?)"
done
stamp "done"
