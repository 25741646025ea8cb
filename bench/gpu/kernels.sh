#!/bin/bash
# Issue 35, fused kernels: the torch engine with TB_ENGINE_KERNELS=none and =liger against plain
# PyTorch + PEFT without and with Liger's kernels (the anchor a PEFT user would pick), batch 8 x 1024,
# LoRA rank 32, bf16, Qwen3 shapes with random weights (bench/gpu/engine_vs_plain.py): tokens/s, MFU,
# peak memory, and each engine run's losses against plain PEFT's over the steps (the fused layers'
# exactness on the GPU, where Liger's Triton kernels run). The pinned version:
# liger-kernel==0.8.5
# Here, once: `bash bench/gpu/snapshot_cost.sh prepare` (var/carry-snapshot: the engine's pinned peft
# and this liger-kernel wheel); then one device call carrying var/carry-snapshot:
#   bash bench/gpu/kernels.sh [shapes=1.7b, or 1.7b 8b where the GPU has over 100 GiB] [steps=10]
# BATCH (8) and SEQ (1024) change the batch (e.g. BATCH=4 for the 8B shape on an 80 GB GPU).
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp}
source bench/gpu/shape_lib.sh
SHAPES=${1:-}
if [ -z "$SHAPES" ]; then
  mem=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
  SHAPES="1.7b"; [ "${mem:-0}" -gt 102400 ] && SHAPES="1.7b 8b"
fi
$TB_PYTHON -c "import liger_kernel, importlib.metadata as m; print('liger-kernel', m.version('liger-kernel'))" || stamp "liger-kernel is missing"
for shape in $SHAPES; do
  write_model "$shape" "$TB/models/qwen3-$shape" || { stamp "$shape: the model could not be written"; continue; }
  stamp "engine_vs_plain.py --model $shape --kernels none,liger --plain-kernels none,liger"
  $TB_PYTHON bench/gpu/engine_vs_plain.py --model "$shape" --steps "${2:-10}" --kernels none,liger --plain-kernels none,liger \
    --batch "${BATCH:-8}" --seq "${SEQ:-1024}" --sample-rounds 0 --keep "$TB/models/qwen3-$shape" 2>&1 | grep -v -i "warn" || stamp "$shape: the bench failed"
done
stamp "done"
