#!/bin/bash
# Issue 31 on one GPU: a torch actor and a vLLM rollout on the same GPU, started by one command,
# with an RL-shaped loop through the SDK (bench/gpu/turns_check.py), two ways side by side:
#   turns  presets/gpu/one_gpu_rl.yaml: they take turns (vLLM sleeps while the actor trains, the actor
#          empties its allocator's cache while vLLM samples), each may use most of the GPU
#   split  presets/gpu/one_gpu_rl_split.yaml: a fixed split (vLLM 35%, actor 55%), no switches
#   inprocess  no broker: vLLM's offline LLM and PEFT in one Python process, vLLM sleeping while PEFT
#          trains (bench/gpu/inprocess_rl.py, the anchor of issue 31 item 5)
#   trl    no broker: TRL's GRPOTrainer with vLLM colocated and sleeping while it trains
#          (bench/gpu/trl_grpo.py; needs .carry-cb, bench/gpu/build_cookbook_carry.sh, carried in the call)
#   direct not the loop: the split preset with vLLM's CUDA graphs on (no --enforce-eager), then
#          bench/gpu/vllm_direct.py: DIRECT_N (32) concurrent one-sample requests of DIRECT_TOKENS (128)
#          through the broker against the same requests sent to the vLLM server itself (issue 36)
# Each prints per-step phase times and the time from save_weights_for_sampler to the first token of
# the new version; nvidia-smi is sampled every 100 ms meanwhile (GPU busy fraction, memory).
# On the device, after the vLLM kit was carried into /tmp/tb/parts (bench/gpu/build_vllm_sdk_carry.sh
# and four calls, as for bench/gpu/vllm_sdk_check.sh):
#   bash bench/gpu/turns_check.sh [ways=turns,split] [steps=4]
# Env: SHAPE (1.7b), TURNS_BATCH_TOKENS (8192) and SPLIT_BATCH_TOKENS (4096): the actor's micro-batch
# bound in each way (what its memory allows), PROMPTS/GROUP/MAX_TOKENS for the loop.
set -uo pipefail
WAYS=${1:-turns,split}
STEPS=${2:-4}
source "$(dirname "$0")/stack_lib.sh"
export SHAPE=${SHAPE:-1.7b}
gpu_stack_setup || exit 1
# gpu_stack_setup wrote the shape into models/h200-qwen3-0.6b; the presets name models/qwen3-1.7b.
mkdir -p models && rm -rf models/qwen3-1.7b && mv models/h200-qwen3-0.6b models/qwen3-1.7b
export TB_VLLM_EXTRA_ARGS="--max-model-len 4096 --enforce-eager" TB_LOG_LEVEL=info HF_HUB_OFFLINE=1 TB_SNAPSHOT_EVERY_STEPS=0
URL=http://127.0.0.1:$PORT
# An anchor without the broker (one Python process), with nvidia-smi sampled meanwhile: anchor NAME SCRIPT ARGS…
anchor() {
  local way=$1; shift
  nvidia-smi --query-gpu=timestamp,utilization.gpu,memory.used --format=csv,noheader,nounits -lms 100 > "$OUT/smi-$way.csv" &
  SMI=$!
  PYTHONPATH=$TB/engsite:$TB/vsite:$TB/cbsite PYTHONUNBUFFERED=1 timeout ${LOOP_S:-300} python3 "$@" \
    --model models/qwen3-1.7b --steps $STEPS --prompts ${PROMPTS:-16} --group ${GROUP:-8} --max-tokens ${MAX_TOKENS:-128} \
    --out "$OUT/summary-$way.json" 2>&1 | grep -E '^(\{|SUMMARY)|Error|Traceback|rror:' | tail -40
  stamp "$way: exited ${PIPESTATUS[0]}"
  kill $SMI 2>/dev/null
  smi_summary "$OUT/smi-$way.csv"
}
for way in ${WAYS//,/ }; do
  if [ "$way" = inprocess ]; then
    stamp "inprocess: vLLM's LLM + PEFT in one process"
    anchor inprocess bench/gpu/inprocess_rl.py --batch-tokens ${TURNS_BATCH_TOKENS:-8192}
    continue
  fi
  if [ "$way" = trl ]; then
    cb_site_setup || continue
    stamp "trl: TRL's GRPOTrainer, vLLM colocated (sleep mode, ${TRL_GPU_MEMORY:-0.35} of the GPU)"
    anchor trl bench/gpu/trl_grpo.py --vllm --sleep --gpu-memory ${TRL_GPU_MEMORY:-0.35}
    continue
  fi
  if [ "$way" = turns ]; then PRESET=presets/gpu/one_gpu_rl.yaml; export TB_ENGINE_MAX_BATCH_TOKENS=${TURNS_BATCH_TOKENS:-8192}
  else PRESET=presets/gpu/one_gpu_rl_split.yaml; export TB_ENGINE_MAX_BATCH_TOKENS=${SPLIT_BATCH_TOKENS:-4096}; fi
  VLLM_ARGS=$TB_VLLM_EXTRA_ARGS
  [ "$way" = direct ] && VLLM_ARGS=${TB_VLLM_EXTRA_ARGS//--enforce-eager/}
  export TB_PORT=$PORT TB_PREFIX=turns-$way TB_STORAGE_DIR=/tmp/tb/storage-$way
  stamp "$way: starting $PRESET (one command; TB_ENGINE_MAX_BATCH_TOKENS=$TB_ENGINE_MAX_BATCH_TOKENS; vLLM: $VLLM_ARGS)"
  TB_VLLM_EXTRA_ARGS=$VLLM_ARGS start_stack "$OUT/$way.log" --preset $PRESET
  if ! wait_for "$way: healthz ready" ${READY_S:-300} "http_has $URL/api/v1/healthz ready" ${PIDS[-1]}; then
    grep -v 'path=/healthz' "$OUT/$way.log" | tail -40 | cut -c1-400; kill -TERM ${PIDS[-1]}; sleep 5; continue
  fi
  if [ "$way" = direct ]; then
    grep -o '"\?ready_s"\?[=:][0-9]*' "$OUT/$way.log" | head -2
    TINKER_BASE_URL=$URL TINKER_API_KEY=tml-local PYTHONUNBUFFERED=1 timeout ${LOOP_S:-200} $SDK_PY bench/gpu/vllm_direct.py \
      --rollout qwen3-1.7b-rollout --agent-log "$OUT/$way.log" --n ${DIRECT_N:-32} --tokens ${DIRECT_TOKENS:-128} \
      --rounds ${DIRECT_ROUNDS:-6} --out "$OUT/summary-direct.json"
    stamp "direct: exited $?"
    kill -TERM ${PIDS[-1]}; for _ in $(seq 60); do kill -0 ${PIDS[-1]} 2>/dev/null || break; sleep 1; done
    continue
  fi
  nvidia-smi --query-gpu=memory.used --format=csv,noheader
  nvidia-smi --query-gpu=timestamp,utilization.gpu,memory.used --format=csv,noheader,nounits -lms 100 > "$OUT/smi-$way.csv" &
  SMI=$!
  TINKER_BASE_URL=$URL TINKER_API_KEY=tml-local PYTHONUNBUFFERED=1 timeout ${LOOP_S:-200} $SDK_PY bench/gpu/turns_check.py \
    --actor qwen3-1.7b --steps $STEPS --prompts ${PROMPTS:-16} --group ${GROUP:-8} --max-tokens ${MAX_TOKENS:-128} --label $way --out "$OUT/summary-$way.json"
  stamp "$way: loop exited $?"
  kill $SMI 2>/dev/null
  smi_summary "$OUT/smi-$way.csv"
  grep -E 'gpu turn (taken|given)' "$OUT/$way.log" | head -6 | cut -c1-300
  grep -i -E 'error|Traceback|OutOfMemory' "$OUT/$way.log" | grep -v 'path=/healthz' | head -10 | cut -c1-400
  kill -TERM ${PIDS[-1]}; for _ in $(seq 60); do kill -0 ${PIDS[-1]} 2>/dev/null || break; sleep 1; done
  stamp "$way: stopped"
done
