# Shared by bench/gpu/vllm_sdk_check.sh and bench/gpu/verl_sdk_check.sh (sourced, not run): the
# clock, the started processes and their cleanup, waiting for the stack, and on the H200 the
# unpacking of what bench/gpu/build_vllm_sdk_carry.sh built and the device calls carried into
# /tmp/tb/parts (vsite.tar.xz.part-N, SHA256SUMS: the vLLM 0.26.0 overlay, node, redis-server, the
# production node_modules, the SDK's wheels under whl/sdk, peft for the engine under whl/eng).
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
REPO=$(pwd)
OUT=${OUT:-$(mktemp -d /tmp/sdk-check.XXXX)}
mkdir -p "$OUT"
T0=$(date +%s)
stamp() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
PIDS=()
cleanup() {
  for p in "${PIDS[@]}"; do kill -TERM "$p" 2>/dev/null; done
  for p in "${PIDS[@]}"; do for _ in $(seq 60); do kill -0 "$p" 2>/dev/null || break; sleep 0.5; done; kill -KILL "$p" 2>/dev/null; done
}
trap cleanup EXIT

# xz when the machine has it, else Python's lzma.
untar() { if command -v xz >/dev/null; then tar -C "$1" -xJf "$2"; else python3 -c "import sys, tarfile; tarfile.open(sys.argv[2], 'r:xz').extractall(sys.argv[1])" "$1" "$2"; fi; }
unxz() { if command -v xz >/dev/null; then xz -dc "$1"; else python3 -c "import lzma, shutil, sys; shutil.copyfileobj(lzma.open(sys.argv[1]), sys.stdout.buffer)" "$1"; fi; }

# On the H200: unpack the carried parts once (a warm machine keeps /tmp/tb), write the wrappers that
# give each program only what it needs on its path (vllm its overlay, the engine peft 0.21, the
# SDK its wheels), print the versions and write the random Qwen3-shaped model.
gpu_stack_setup() {
  TB=${TB:-/tmp/tb}
  mkdir -p $TB/bin
  if [ ! -f $TB/.unpacked ]; then
    stamp "joining and unpacking the carried parts"
    ( cd $TB/parts && cat vsite.tar.xz.part-* > vsite.tar.xz && sha256sum -c SHA256SUMS ) || return 1
    mkdir -p $TB/vsite && untar $TB/vsite $TB/parts/vsite.tar.xz && rm $TB/parts/vsite.tar.xz || return 1
    unxz $TB/parts/node.xz > $TB/bin/node && chmod +x $TB/bin/node
    untar $TB $TB/parts/redis.tar.xz
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target $TB/sdksite $TB/parts/whl/sdk/*.whl
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target $TB/engsite $TB/parts/whl/eng/*.whl
    touch $TB/.unpacked
    stamp "unpacked"
  fi
  [ -d "$REPO/node_modules" ] || untar "$REPO" $TB/parts/nm.tar.xz
  printf '#!/bin/sh\nLD_LIBRARY_PATH=%s/redis exec %s/redis/redis-server "$@"\n' $TB $TB > $TB/bin/redis-server
  printf '#!/bin/sh\nPYTHONPATH=%s/vsite exec python3 -m vllm.entrypoints.cli.main "$@"\n' $TB > $TB/bin/vllm
  printf '#!/bin/sh\nPYTHONPATH=%s/engsite${PYTHONPATH:+:$PYTHONPATH} exec python3 "$@"\n' $TB > $TB/bin/pyeng
  chmod +x $TB/bin/*
  export PATH=$TB/bin:$PATH
  export TB_PYTHON=$TB/bin/pyeng TB_VLLM_BIN=$TB/bin/vllm VLLM_USE_FLASHINFER_SAMPLER=0
  export TB_VLLM_EXTRA_ARGS=${TB_VLLM_EXTRA_ARGS:---gpu-memory-utilization 0.35 --max-model-len 4096 --enforce-eager}
  SDK_PY="env PYTHONPATH=$TB/sdksite:$TB/vsite python3"
  PORT=8000
  stamp "versions"
  nvidia-smi --query-gpu=name,memory.total,memory.used,driver_version --format=csv
  node --version; redis-server --version
  PYTHONPATH=$TB/vsite python3 -c "import vllm, torch, transformers; print('vllm', vllm.__version__, 'torch', torch.__version__, 'transformers', transformers.__version__)"
  $TB_PYTHON -c "import peft, transformers; print('engine: peft', peft.__version__, 'transformers', transformers.__version__)"
  $SDK_PY -c "import tinker, pydantic; print('sdk: tinker', tinker.__version__, 'pydantic', pydantic.__version__)"
  stamp "writing the model"
  python3 bench/gpu/make_random_qwen3.py --shape "${SHAPE:-0.6b}" --out models/h200-qwen3-0.6b --device cuda || return 1
}

# Here: a stack of its own (port, Redis prefix, storage directory), the SDK from .venv.
cpu_stack_setup() {
  SDK_PY=.venv/bin/python
  PORT=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
  export TB_PREFIX=sdk-check-$$ TB_STORAGE_DIR=$OUT/storage
}

wait_for() {  # what, seconds, command (quiet), pid to watch
  local what=$1 secs=$2 cmd=$3 pid=$4 t=$(date +%s)
  until eval "$cmd" >/dev/null 2>&1; do
    if ! kill -0 "$pid" 2>/dev/null; then stamp "$what: the process exited"; return 1; fi
    if [ $(( $(date +%s) - t )) -ge "$secs" ]; then stamp "$what: timed out after $secs s"; return 1; fi
    sleep 1
  done
  stamp "$what after $(( $(date +%s) - t )) s"
}
# GET a URL (python3: the machine may have no curl); true when the answer is 200 and contains $2.
http_has() { python3 -c "
import sys, urllib.request
r = urllib.request.urlopen(urllib.request.Request(sys.argv[1], headers={'X-API-Key': 'tml-local'}), timeout=5)
sys.exit(0 if r.status == 200 and sys.argv[2] in r.read().decode() else 1)" "$1" "$2"; }
# Start `tinker-broker start ARGS…` in the background, its output in LOG; its pid is appended to PIDS.
start_stack() {  # log, args…
  local log=$1; shift
  node scripts/tinker-broker.mjs start "$@" > "$log" 2>&1 &
  PIDS+=($!)
}
# The cookbook's and the TRL anchor's Python packages (.carry-cb, bench/gpu/build_cookbook_carry.sh),
# installed once into $TB/cbsite (put it on PYTHONPATH after vLLM's site).
cb_site_setup() {
  [ -d $TB/cbsite ] && return 0
  [ -d .carry-cb ] || { stamp "no .carry-cb: build it with bench/gpu/build_cookbook_carry.sh and carry it"; return 1; }
  (cd .carry-cb && sha256sum -c --quiet SHA256SUMS) || return 1
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target $TB/cbsite .carry-cb/whl/*.whl
}

# nvidia-smi's 100 ms samples in FILE (utilization, memory), summarised: mean utilization, share of
# samples with any kernel running, memory used.
smi_summary() {  # file
  python3 - "$1" <<'EOF'
import sys
rows = [l.split(", ") for l in open(sys.argv[1]) if l.count(",") == 2]
util = [float(r[1]) for r in rows if r[1].strip().replace('.', '', 1).isdigit()]
mem = [float(r[2]) for r in rows if r[2].strip().replace('.', '', 1).isdigit()]
if util:
    print(f"nvidia-smi: {len(util)} samples, utilization mean {sum(util)/len(util):.1f}%, "
          f"busy (>0%) {100*sum(u > 0 for u in util)/len(util):.1f}% of samples, memory used min {min(mem):.0f} max {max(mem):.0f} MiB")
EOF
}
