#!/bin/bash
# bench/overhead.ts (with its floor, bench/floor.ts) on the H200 machine: 16 cores instead of two,
# the torch engine on the CPU and then on the GPU, the tiny model. Here, once:
#   bash bench/gpu/overhead_check.sh prepare      (builds bench/gpu/build_stack_carry.sh's kit into
#                                                 /tmp/stack-carry and copies it to .carry-o/, git-excluded)
# then through the device tool, carrying .carry-o and models:
#   bash bench/gpu/overhead_check.sh [ops1=300] [ops64=8] [sdkSteps=100]
set -euo pipefail
cd "$(dirname "$0")/../.."
if [ "${1:-}" = prepare ]; then
  bash bench/gpu/build_stack_carry.sh /tmp/stack-carry
  grep -q '^/.carry-\*/$' .git/info/exclude 2>/dev/null || echo '/.carry-*/' >> .git/info/exclude
  rm -rf .carry-o && mkdir -p .carry-o && cp -r /tmp/stack-carry/node.xz /tmp/stack-carry/redis.tar.xz /tmp/stack-carry/nm.tar.xz /tmp/stack-carry/whl .carry-o/
  du -sh .carry-o models
  exit 0
fi
source bench/gpu/stack_lib.sh
TB=/tmp/tbo
mkdir -p $TB/bin
[ -x $TB/bin/node ] || { unxz .carry-o/node.xz > $TB/bin/node.part && chmod +x $TB/bin/node.part && mv $TB/bin/node.part $TB/bin/node; }
[ -d $TB/redis ] || untar $TB .carry-o/redis.tar.xz
[ -d $TB/sdksite/pydantic ] || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target $TB/sdksite .carry-o/whl/sdk/*.whl .carry-o/whl/sdkdeps/*.whl
[ -d node_modules ] || untar . .carry-o/nm.tar.xz
printf '#!/bin/sh\nLD_LIBRARY_PATH=%s/redis exec %s/redis/redis-server "$@"\n' $TB $TB > $TB/bin/redis-server
chmod +x $TB/bin/*
export PATH=$TB/bin:$PATH
# The benches run `.venv/bin/python` (the engine, the SDK, the floor's engine): the device's Python
# with the SDK's wheels beside it.
mkdir -p .venv/bin
printf '#!/bin/sh\nPYTHONPATH=%s/sdksite${PYTHONPATH:+:$PYTHONPATH} exec python3 "$@"\n' $TB > .venv/bin/python
chmod +x .venv/bin/python
redis-server --port 6379 --save '' --appendonly no --daemonize yes --logfile $OUT/redis.log
stamp "versions"
nproc; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; node --version; redis-server --version
.venv/bin/python -c "import torch, transformers, peft, tinker; print('torch', torch.__version__, 'transformers', transformers.__version__, 'peft', peft.__version__, 'tinker', tinker.__version__)"
for dev in cpu cuda; do
  stamp "bench/overhead.ts, engine on $dev"
  TB_ENGINE_DEVICE=$dev node --import tsx bench/overhead.ts "${1:-300}" "${2:-8}" "${3:-100}"
done
stamp "done"
