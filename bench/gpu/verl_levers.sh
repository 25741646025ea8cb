#!/usr/bin/env bash
# The verl engine's levers on the GPU (issue 35 item 3; bench/gpu/verl_levers.py says what it runs):
# padded (the engine before) against the levers tinker_engine_verl/levers.py chooses, at a Qwen3 shape,
# mixed lengths and then equal ones. On the GPU machine, with the kit of bench/gpu/build_verl_carry.sh
# carried as .verlcarry:
#   bash bench/gpu/verl_levers.sh [shape=1.7b] [steps=5] [extra verl_levers.py options]
# Here, without a GPU (verl from scripts/setup-verl.sh): PYTHONPATH=var/verlsite .venv/bin/python bench/gpu/verl_levers.py --cpu
set -uo pipefail
cd "$(dirname "$0")/../.."
PY="${PYTHON:-python3}"
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS="${OMP_NUM_THREADS:-4}" HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
source bench/gpu/verl_kit.sh || exit 1
SHAPE=${1:-1.7b} STEPS=${2:-5}
shift $(( $# > 2 ? 2 : $# ))
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
echo "== mixed lengths (16 datums, 64..2048 tokens)"
"$PY" bench/gpu/verl_levers.py --model "$SHAPE" --steps "$STEPS" --keep "/tmp/verl_levers/qwen3-$SHAPE" "$@" 2>&1 | grep -v -i "warn"
echo "== equal lengths (8 x 1024 tokens)"
"$PY" bench/gpu/verl_levers.py --model "$SHAPE" --steps "$STEPS" --keep "/tmp/verl_levers/qwen3-$SHAPE" --equal --datums 8 --max-len 1024 "$@" 2>&1 | grep -v -i "warn"
echo "[verl_levers] done"
