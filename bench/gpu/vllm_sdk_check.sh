#!/bin/bash
# The whole stack (Redis, API, a torch actor agent, a vLLM rollout agent) started from a preset with
# the launcher, then bench/gpu/vllm_sdk_check.py through the Tinker SDK. Logs and the summary go to
# $OUT (default: a temporary directory).
#
#   bash bench/gpu/vllm_sdk_check.sh gpu   # on the H200 device, after the carried parts are in /tmp/tb/parts
#   bash bench/gpu/vllm_sdk_check.sh cpu   # here: presets/cpu/tiny_vllm.yaml, .venv and .venv-vllm
#
# gpu: unpacks what was carried into /tmp/tb/parts (vsite.tar.xz.part-N, SHA256SUMS: the vLLM 0.26.0 overlay, node, redis-server, the production
# node_modules, the SDK's wheels under whl/sdk, peft for the engine under whl/eng), writes the random Qwen3-0.6B-shaped model, and starts
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
  TB=${TB:-/tmp/tb}
  mkdir -p $TB/bin
  if [ ! -f $TB/.unpacked ]; then
    stamp "joining and unpacking the carried parts"
    ( cd $TB/parts && cat vsite.tar.xz.part-* > vsite.tar.xz && sha256sum -c SHA256SUMS ) || exit 1
    # xz when the machine has it, else Python's lzma.
    untar() { if command -v xz >/dev/null; then tar -C "$1" -xJf "$2"; else python3 -c "import sys, tarfile; tarfile.open(sys.argv[2], 'r:xz').extractall(sys.argv[1])" "$1" "$2"; fi; }
    unxz() { if command -v xz >/dev/null; then xz -dc "$1"; else python3 -c "import lzma, shutil, sys; shutil.copyfileobj(lzma.open(sys.argv[1]), sys.stdout.buffer)" "$1"; fi; }
    mkdir -p $TB/vsite && untar $TB/vsite $TB/parts/vsite.tar.xz && rm $TB/parts/vsite.tar.xz || exit 1
    unxz $TB/parts/node.xz > $TB/bin/node && chmod +x $TB/bin/node
    untar $TB $TB/parts/redis.tar.xz
    untar "$REPO" $TB/parts/nm.tar.xz
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
# GET a URL (python3: the machine may have no curl); true when the answer is 200 and contains $2.
http_has() { python3 -c "
import sys, urllib.request
r = urllib.request.urlopen(urllib.request.Request(sys.argv[1], headers={'X-API-Key': 'tml-local'}), timeout=5)
sys.exit(0 if r.status == 200 and sys.argv[2] in r.read().decode() else 1)" "$1" "$2"; }
caps="http_has $URL/api/v1/get_server_capabilities '\"trainable\":true'"

stamp "starting the API and the actor ($PRESET --agent $ACTOR_AGENT)"
node scripts/tinker-broker.mjs start --preset $PRESET --agent $ACTOR_AGENT > "$OUT/api-actor.log" 2>&1 &
PIDS+=($!)
wait_for "actor serves its model" 300 "$caps" ${PIDS[0]} || { tail -50 "$OUT/api-actor.log"; exit 1; }
[ "$MODE" = gpu ] && nvidia-smi --query-gpu=memory.used --format=csv
stamp "starting the vLLM agent ($PRESET --agent $VLLM_AGENT --agents-only; TB_VLLM_EXTRA_ARGS=${TB_VLLM_EXTRA_ARGS:-})"
node scripts/tinker-broker.mjs start --preset $PRESET --agent $VLLM_AGENT --agents-only > "$OUT/vllm-agent.log" 2>&1 &
PIDS+=($!)
wait_for "healthz ready (both agents serve their models)" ${VLLM_WAIT_S:-360} "http_has $URL/api/v1/healthz ready" ${PIDS[1]} || { tail -80 "$OUT/vllm-agent.log"; exit 1; }
grep -o '"ready_s":[0-9]*' "$OUT/vllm-agent.log" | head -1
grep -m1 'starting vLLM' "$OUT/vllm-agent.log" | cut -c1-600
[ "$MODE" = gpu ] && nvidia-smi --query-gpu=memory.used --format=csv

stamp "SDK check"
TINKER_BASE_URL=$URL TINKER_API_KEY=tml-local PYTHONUNBUFFERED=1 timeout ${SDK_TIMEOUT_S:-420} $SDK_PY bench/gpu/vllm_sdk_check.py \
  --actor $ACTOR --rollout $ROLLOUT --out "$OUT/summary.json" --phases "${PHASES:-compare,mixed,throughput}" "$@"
RC=$?
stamp "SDK check exited $RC"
echo "--- vLLM agent log (LoRA, warnings, errors) ---"
grep -v 'path=/healthz' "$OUT/vllm-agent.log" | grep -i -E 'lora|warn|error|exception|Traceback' | cut -c1-400 | tail -40
echo "--- actor log (warnings, errors) ---"
grep -v 'path=/healthz' "$OUT/api-actor.log" | grep -i -E 'warn|error|exception|Traceback' | cut -c1-400 | tail -20
[ "$MODE" = gpu ] && nvidia-smi --query-gpu=memory.used --format=csv

# vLLM's prompt logprobs with LoRA straight against its server, without the adapter's gate (last: it may kill vLLM).
if [ "${PROBE:-$([ "$MODE" = gpu ] && echo 1 || echo 0)}" = 1 ] && [ -f "$OUT/summary.json" ]; then
  stamp "probe: prompt logprobs alone, n=4, and during other requests"
  PROMPT=$(python3 -c "import json; s=json.load(open('$OUT/summary.json')); print(','.join(map(str, s['prompt']['P'] + s['prompt']['C'])))")
  timeout 180 python3 bench/gpu/vllm_prompt_logprobs_probe.py --agent-log "$OUT/vllm-agent.log" --prompt "$PROMPT" --out "$OUT/probe.json"
  stamp "probe done"
fi

# With CUDA graphs and torch.compile (no --enforce-eager): start-up time and throughput, when time is left.
# The device's calls end at 600 s: by default the pass gets what is left of 570 s.
if [ "$MODE" = gpu ] && [ "${GRAPHS:-1}" = 1 ] && [ $(( $(date +%s) - T0 )) -lt ${GRAPHS_IF_BEFORE_S:-330} ]; then
  stamp "restarting the vLLM agent without --enforce-eager"
  kill -TERM ${PIDS[1]}; for _ in $(seq 60); do kill -0 ${PIDS[1]} 2>/dev/null || break; sleep 1; done
  export TB_VLLM_EXTRA_ARGS="${TB_VLLM_EXTRA_ARGS//--enforce-eager/}"
  node scripts/tinker-broker.mjs start --preset $PRESET --agent $VLLM_AGENT --agents-only > "$OUT/vllm-agent-graphs.log" 2>&1 &
  PIDS+=($!)
  if wait_for "healthz ready (graphs)" ${GRAPHS_WAIT_S:-$(( 570 - ($(date +%s) - T0) - 90 ))} "http_has $URL/api/v1/healthz ready" ${PIDS[2]}; then
    grep -o '"ready_s":[0-9]*' "$OUT/vllm-agent-graphs.log" | head -1
    TINKER_BASE_URL=$URL TINKER_API_KEY=tml-local PYTHONUNBUFFERED=1 timeout $(( 575 - ($(date +%s) - T0) )) $SDK_PY bench/gpu/vllm_sdk_check.py \
      --actor $ACTOR --rollout $ROLLOUT --out "$OUT/summary-graphs.json" --phases "${GRAPHS_PHASES:-throughput}" "$@"
    stamp "graphs pass exited $?"
  else
    grep -v 'path=/healthz' "$OUT/vllm-agent-graphs.log" | tail -30 | cut -c1-400
  fi
fi
exit $RC
