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
source "$(dirname "$0")/stack_lib.sh"
if [ "$MODE" = gpu ]; then
  gpu_stack_setup || exit 1
  PRESET=presets/gpu/h200_vllm.yaml; ACTOR_AGENT=h200-actor; VLLM_AGENT=h200-vllm
  ACTOR=h200-qwen3-0.6b; ROLLOUT=h200-qwen3-0.6b-rollout
else
  cpu_stack_setup
  PRESET=presets/cpu/tiny_vllm.yaml; ACTOR_AGENT=cpu-actor; VLLM_AGENT=cpu-vllm
  ACTOR=tiny-qwen3; ROLLOUT=tiny-qwen3-rollout
fi
export TB_PORT=$PORT TB_LOG_LEVEL=${TB_LOG_LEVEL:-info} HF_HUB_OFFLINE=1
URL=http://127.0.0.1:$PORT
caps="http_has $URL/api/v1/get_server_capabilities '\"trainable\":true'"

stamp "starting the API and the actor ($PRESET --agent $ACTOR_AGENT)"
start_stack "$OUT/api-actor.log" --preset $PRESET --agent $ACTOR_AGENT
wait_for "actor serves its model" 300 "$caps" ${PIDS[0]} || { tail -50 "$OUT/api-actor.log"; exit 1; }
[ "$MODE" = gpu ] && nvidia-smi --query-gpu=memory.used --format=csv
stamp "starting the vLLM agent ($PRESET --agent $VLLM_AGENT --agents-only; TB_VLLM_EXTRA_ARGS=${TB_VLLM_EXTRA_ARGS:-})"
start_stack "$OUT/vllm-agent.log" --preset $PRESET --agent $VLLM_AGENT --agents-only
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
  start_stack "$OUT/vllm-agent-graphs.log" --preset $PRESET --agent $VLLM_AGENT --agents-only
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
