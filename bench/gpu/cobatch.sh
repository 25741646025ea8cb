#!/bin/bash
# bench/cobatch.ts on the H200 machine (issue 34): N training loops with small batches on one agent,
# one after another, all at once, and all at once co-batched (TB_COBATCH_MAX=N), at Qwen3-1.7B's
# (and 8B's) shape, random-initialised, bf16, LoRA rank 32, the torch engine on the GPU; the start
# command as a user starts it. Carry var/carry-snapshot (`bash bench/gpu/snapshot_cost.sh prepare`):
#   bash bench/gpu/cobatch.sh [shape:loops,...=1.7b:2,1.7b:4,1.7b:8] [steps=20] [datums=2] [seqLen=256]
# COBATCH_WAIT_MS (25) is the windowed run's gather window (0: no windowed run). With MEMBERS (e.g. 1,4)
# the same call also times, in one process, one grouped pass of that many members at the same shape and
# batch (bench/gpu/profile_train.py --members): the product's pass against the engine's own.
# CPU smoke test: TB_PYTHON=.venv/bin/python DEVICE=cpu bash bench/gpu/cobatch.sh tiny:2 3 2 16
set -euo pipefail
cd "$(dirname "$0")/../.."
RUNS=${1:-1.7b:2,1.7b:4,1.7b:8}
STEPS=${2:-20} DATUMS=${3:-2} SEQLEN=${4:-256}
source bench/gpu/shape_lib.sh

for spec in ${RUNS//,/ }; do
  shape=${spec%%:*} loops=${spec#*:}
  write_model "$shape" "$TB/models/qwen3-$shape" || { stamp "$shape: the model could not be written"; continue; }
  stamp "bench/cobatch.ts: Qwen3 $shape shape on $DEVICE, $loops loops x $STEPS steps of $DATUMS x $SEQLEN tokens"
  node --import tsx bench/cobatch.ts "$loops" "$STEPS" "$DATUMS" "$SEQLEN" "$TB/models/qwen3-$shape" "$DEVICE" || stamp "$shape x $loops: the bench failed (exit $?)"
  if [ -n "${MEMBERS:-}" ] && [ "$shape" != tiny ]; then
    stamp "in one process: profile_train.py --members $MEMBERS ($shape shape, $DATUMS x $SEQLEN tokens per member)"
    $TB_PYTHON bench/gpu/profile_train.py --model "$shape" --batch "$DATUMS" --seq "$SEQLEN" --steps 5 --members "$MEMBERS" 2>&1 | grep -v -i warn | tail -20 || stamp "profile_train failed"
  fi
done
stamp "done"
