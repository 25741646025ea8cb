#!/bin/bash
# bench/snapshot-cost.ts on the H200 machine (issue 32): what a snapshot after every optim_step costs
# the training loop, and how long each one holds the op stream, at Qwen3-1.7B's and Qwen3-8B's
# shapes (random-initialised, bf16, bench/gpu/engine_vs_plain.py's MODELS), LoRA rank 32, batch
# 8 x 1024 tokens, the torch engine on the GPU; the start command as a user starts it. Here, once:
#   bash bench/gpu/snapshot_cost.sh prepare   (bench/gpu/build_stack_carry.sh's node, redis-server and
#                                             production node_modules into var/carry-snapshot, git-ignored)
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
  du -sh $C
  exit 0
fi
source bench/gpu/stack_lib.sh
SHAPES=${1:-1.7b:20,8b:15}
ROUNDS=${2:-2}
RANK=${RANK:-32} SEQ=${SEQ:-1024} BATCH=${BATCH:-8} WARMUP=${WARMUP:-3} DEVICE=${DEVICE:-cuda}
export TB_PYTHON=${TB_PYTHON:-python3}
TB=/tmp/tbs
mkdir -p $TB/bin $TB/models
[ -x $TB/bin/node ] || { unxz $C/node.xz > $TB/bin/node.part && chmod +x $TB/bin/node.part && mv $TB/bin/node.part $TB/bin/node; }
[ -d $TB/redis ] || untar $TB $C/redis.tar.xz
[ -d node_modules ] || untar . $C/nm.tar.xz
printf '#!/bin/sh\nLD_LIBRARY_PATH=%s/redis exec %s/redis/redis-server "$@"\n' $TB $TB > $TB/bin/redis-server
chmod +x $TB/bin/*
export PATH=$TB/bin:$PATH
redis_up() { python3 -c "import socket; socket.create_connection(('127.0.0.1', 6379), 1)" 2>/dev/null; }
redis_up || redis-server --port 6379 --save '' --appendonly no --daemonize yes --logfile $OUT/redis.log
wait_for "redis" 20 redis_up $$

stamp "versions"
nproc; free -g | head -2
nvidia-smi --query-gpu=name,memory.total,memory.used,driver_version --format=csv,noheader || echo "no nvidia-smi"
df -h /tmp | tail -1; echo "/tmp file system: $(stat -f -c %T /tmp)"
node --version; redis-server --version
$TB_PYTHON -c "import torch, transformers, peft; print('torch', torch.__version__, 'transformers', transformers.__version__, 'peft', peft.__version__)"

# A shape's model directory, written once (a .part directory renamed when complete).
write_model() {  # shape, dir
  if [ -d "$2" ]; then stamp "$2: already written"; return 0; fi
  rm -rf "$2.part"
  $TB_PYTHON - "$1" "$2.part" "$DEVICE" <<'EOF' || return 1
import sys, time
from pathlib import Path
import torch
sys.path.insert(0, "bench/gpu")
from engine_vs_plain import MODELS, write_model
shape, out, device = sys.argv[1], Path(sys.argv[2]), sys.argv[3]
t = time.time()
write_model(shape, out, torch.device(device), torch.bfloat16)
print(f"Qwen3 {shape} shape {MODELS[shape]}, bf16, written in {time.time() - t:.1f} s")
EOF
  mv "$2.part" "$2"
}

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
