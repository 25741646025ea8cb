#!/bin/bash
# test/e2e/verl-ranks.test.ts on GPUs (issue 37 item 1): verl FSDP2 over 1, 2 and 4 GPUs and VeOmni
# over 2, through the product, with the GPU layout test/fixtures/verl-ranks/gpu_verl_ranks.yaml
# (the test itself unchanged; it switches to its bf16 tolerances when the preset's devices are cuda).
# Needs a 4-GPU kind (nvidia-h100-x4 or nvidia-h200-x4) and, as for bench/gpu/verl_sdk_check.sh, the
# four parts of build_vllm_sdk_carry.sh in /tmp/tb/parts (node, redis-server, the SDK, the vLLM
# overlay), the verl kit as .verlcarry (build_verl_carry.sh), the VeOmni kit as .veomnicarry
# (build_veomni_carry.sh; optional: without it the VeOmni test is skipped), and node_modules with the
# dev dependencies (mocha, chai, tsx: `npm ci` here, carried as part of the source). Then:
#
#   run(kind="nvidia-h100-x4", carry=[".verlcarry", ".veomnicarry", ...], command="bash bench/gpu/verl_ranks.sh")
#
# On this machine `bash bench/gpu/verl_ranks.sh cpu` runs the CPU fixture (scripts/setup-verl.sh first).
set -uo pipefail
MODE=${1:-gpu}
source "$(dirname "$0")/stack_lib.sh"
if [ "$MODE" = gpu ]; then
  gpu_stack_setup || exit 1
  nvidia-smi -L
  [ "$(nvidia-smi -L | wc -l)" -ge 4 ] || { echo "needs 4 GPUs (a nvidia-h100-x4 or nvidia-h200-x4 kind)"; exit 2; }
  if [ ! -f $TB/.verl ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target $TB/verlsite .verlcarry/*.whl || exit 1
    touch $TB/.verl
  fi
  if [ -d .veomnicarry ] && [ ! -f $TB/.veomni ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target $TB/veomnisite .veomnicarry/*.whl || exit 1
    touch $TB/.veomni
  fi
  [ -x node_modules/.bin/mocha ] || { echo "node_modules/.bin/mocha missing: carry node_modules with the dev dependencies"; exit 2; }
  export TB_VERL_RANKS_PRESET=test/fixtures/verl-ranks/gpu_verl_ranks.yaml
  # The engine's PYTHONPATH: peft for the engine (engsite), verl's kit; the SDK driver runs on $SDK_PY's.
  export TB_VERL_SITE=$TB/verlsite TB_VEOMNI_SITE=$TB/veomnisite PYTHONPATH=$TB/engsite
  printf '#!/bin/sh\nPYTHONPATH=%s/sdksite:%s/vsite exec python3 "$@"\n' $TB $TB > $TB/bin/pysdk && chmod +x $TB/bin/pysdk
  export TB_VERL_RANKS_SDK_PYTHON=$TB/bin/pysdk
else
  cpu_stack_setup
fi
export TB_LOG_LEVEL=${TB_LOG_LEVEL:-warn} HF_HUB_OFFLINE=1
stamp "test/e2e/verl-ranks.test.ts ($MODE, preset ${TB_VERL_RANKS_PRESET:-test/fixtures/verl-ranks/cpu_verl_ranks.yaml})"
node_modules/.bin/mocha --no-config --node-option import=tsx --timeout 900000 --exit test/e2e/verl-ranks.test.ts 2>&1 | tee "$OUT/verl-ranks.log"
RC=${PIPESTATUS[0]}
stamp "exited $RC; log $OUT/verl-ranks.log"
exit $RC
