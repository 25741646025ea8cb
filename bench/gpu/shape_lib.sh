# Shared by bench/gpu/snapshot_cost.sh and bench/gpu/cobatch.sh (sourced, not run): on the GPU
# machine, node, redis-server and the production node_modules from the carry that
# `bash bench/gpu/snapshot_cost.sh prepare` built (var/carry-snapshot), the engine's pinned peft from
# it (where the carry has the wheel and TB_PYTHON was not given), Redis started when none answers, the
# versions printed, and `write_model SHAPE DIR`: a random Qwen3 of that shape
# (bench/gpu/engine_vs_plain.py's MODELS), bf16, written once.
C=var/carry-snapshot
source bench/gpu/stack_lib.sh
DEVICE=${DEVICE:-cuda}
TB=/tmp/tbs
mkdir -p $TB/bin $TB/models
if [ -z "${TB_PYTHON:-}" ] && ls $C/whl/peft-*.whl >/dev/null 2>&1; then
  [ -d $TB/engsite ] || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target $TB/engsite $C/whl/*.whl
  printf '#!/bin/sh\nPYTHONPATH=%s/engsite${PYTHONPATH:+:$PYTHONPATH} exec python3 "$@"\n' $TB > $TB/bin/pyeng
  chmod +x $TB/bin/pyeng
  TB_PYTHON=$TB/bin/pyeng
fi
export TB_PYTHON=${TB_PYTHON:-python3}
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

