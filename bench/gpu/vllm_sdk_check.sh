#!/bin/bash
# The whole stack (Redis, API, a torch actor agent, a vLLM rollout agent) started from a preset with
# the launcher, then bench/gpu/vllm_sdk_check.py through the Tinker SDK. Logs and the summary go to
# $OUT (default: a temporary directory).
#
#   bash bench/gpu/vllm_sdk_check.sh gpu   # on the H200 device, after the carried parts are in /tmp/tb/parts
#   bash bench/gpu/vllm_sdk_check.sh cpu   # here: presets/cpu/tiny_vllm.yaml, .venv and .venv-vllm
#
# gpu: unpacks what was carried into /tmp/tb (vLLM 0.26.0 overlay, node, redis-server, the production
# node_modules, the SDK's wheels), writes the random Qwen3-0.6B-shaped model, and starts
# presets/gpu/h200_vllm.yaml: the API and the actor first, then the vLLM agent once the actor serves
# its model (both on GPU 0). Extra arguments after the mode go to vllm_sdk_check.py.
set -uo pipefail
MODE=${1:?gpu or cpu}; shift
cd "$(dirname "$0")/../.."
REPO=$(pwd)
OUT=${OUT:-$(mktemp -d /tmp/vllm-sdk-check.XXXX)}
mkdir -p "$OUT"
T0=$(date +%s)
stamp() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
PIDS=()
cleanup() {
  for p in "${PIDS[@]}"; do kill -TERM "$p" 2>/dev/null; done
  for p in "${PIDS[@]}"; do for _ in $(seq 60); do kill -0 "$p" 2>/dev/null || break; sleep 0.5; done; kill -KILL "$p" 2>/dev/null; done
}
trap cleanup EXIT

if [ "$MODE" = gpu ]; then
  TB=/tmp/tb
  mkdir -p $TB/bin
  if [ ! -f $TB/.unpacked ]; then
    stamp "joining and unpacking the carried parts"
    ( cd $TB/parts && cat vsite.tar.xz.part-* > $TB/vsite.tar.xz && cd $TB && cp parts/SHA256SUMS . && sha256sum -c --ignore-missing SHA256SUMS ) || exit 1
    mkdir -p $TB/vsite && tar -C $TB/vsite -xJf $TB/vsite.tar.xz && rm $TB/vsite.tar.xz
    xz -dc $TB/parts/node.xz > $TB/bin/node && chmod +x $TB/bin/node
    tar -C $TB -xJf $TB/parts/redis.tar.xz
    tar -C "$REPO" -xJf $TB/parts/nm.tar.xz
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target $TB/sdksite $TB/parts/whl/sdk/*.whl
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target $TB/engsite $TB/parts/whl/eng/*.whl
    touch $TB/.unpacked
    stamp "unpacked"
  fi
  # Each program gets only what it needs on its path: vLLM its overlay, the engine peft 0.21, the SDK its wheels.
  printf '#!/bin/sh\nLD_LIBRARY_PATH=%s/redis exec %s/redis/redis-server "$@"\n' $TB $TB > $TB/bin/redis-server
  printf '#!/bin/sh\nPYTHONPATH=%s/vsite exec python3 -m vllm.entrypoints.cli.main "$@"\n' $TB > $TB/bin/vllm
  printf '#!/bin/sh\nPYTHONPATH=%s/engsite${PYTHONPATH:+:$PYTHONPATH} exec python3 "$@"\n' $TB > $TB/bin/pyeng
  chmod +x $TB/bin/*
  export PATH=$TB/bin:$PATH
  PRESET=presets/gpu/h200_vllm.yaml; ACTOR_AGENT=h200-actor; VLLM_AGENT=h200-vllm
  ACTOR=h200-qwen3-0.6b; ROLLOUT=h200-qwen3-0.6b-rollout
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
  python3 bench/gpu/make_random_qwen3.py --shape "${SHAPE:-0.6b}" --out models/h200-qwen3-0.6b --device cuda || exit 1
else
  PRESET=presets/cpu/tiny_vllm.yaml; ACTOR_AGENT=cpu-actor; VLLM_AGENT=cpu-vllm
  ACTOR=tiny-qwen3; ROLLOUT=tiny-qwen3-rollout
  SDK_PY=.venv/bin/python
  PORT=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
  export TB_PREFIX=vllm-sdk-check-$$ TB_STORAGE_DIR=$OUT/storage
fi
export TB_PORT=$PORT TB_LOG_LEVEL=${TB_LOG_LEVEL:-info} HF_HUB_OFFLINE=1
URL=http://127.0.0.1:$PORT
wait_for() {  # what, seconds, command (quiet), pid to watch
  local what=$1 secs=$2 cmd=$3 pid=$4 t=$(date +%s)
  until eval "$cmd" >/dev/null 2>&1; do
    if ! kill -0 "$pid" 2>/dev/null; then stamp "$what: the process exited"; return 1; fi
    if [ $(( $(date +%s) - t )) -ge "$secs" ]; then stamp "$what: timed out after $secs s"; return 1; fi
    sleep 1
  done
  stamp "$what after $(( $(date +%s) - t )) s"
}
caps="curl -sf -H 'X-API-Key: tml-local' $URL/api/v1/get_server_capabilities | grep -q '\"trainable\":true'"

stamp "starting the API and the actor ($PRESET --agent $ACTOR_AGENT)"
node scripts/tinker-broker.mjs start --preset $PRESET --agent $ACTOR_AGENT > "$OUT/api-actor.log" 2>&1 &
PIDS+=($!)
wait_for "actor serves its model" 300 "$caps" ${PIDS[0]} || { tail -50 "$OUT/api-actor.log"; exit 1; }
[ "$MODE" = gpu ] && nvidia-smi --query-gpu=memory.used --format=csv
stamp "starting the vLLM agent ($PRESET --agent $VLLM_AGENT --agents-only; TB_VLLM_EXTRA_ARGS=${TB_VLLM_EXTRA_ARGS:-})"
node scripts/tinker-broker.mjs start --preset $PRESET --agent $VLLM_AGENT --agents-only > "$OUT/vllm-agent.log" 2>&1 &
PIDS+=($!)
wait_for "healthz ready (both agents serve their models)" ${VLLM_WAIT_S:-600} "curl -sf $URL/api/v1/healthz | grep -q ready" ${PIDS[1]} || { tail -80 "$OUT/vllm-agent.log"; exit 1; }
grep -o '"ready_s":[0-9]*' "$OUT/vllm-agent.log" | head -1
grep -m1 'starting vLLM' "$OUT/vllm-agent.log" | cut -c1-600
[ "$MODE" = gpu ] && nvidia-smi --query-gpu=memory.used --format=csv

stamp "SDK check"
TINKER_BASE_URL=$URL TINKER_API_KEY=tml-local PYTHONUNBUFFERED=1 $SDK_PY bench/gpu/vllm_sdk_check.py \
  --actor $ACTOR --rollout $ROLLOUT --out "$OUT/summary.json" "$@"
RC=$?
stamp "SDK check exited $RC"
echo "--- vLLM agent log (LoRA, warnings, errors) ---"
grep -i -E 'lora|warn|error|exception|Traceback' "$OUT/vllm-agent.log" | cut -c1-400 | tail -40
echo "--- actor log (warnings, errors) ---"
grep -i -E 'warn|error|exception|Traceback' "$OUT/api-actor.log" | cut -c1-400 | tail -20
exit $RC
