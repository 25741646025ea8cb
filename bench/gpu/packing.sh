#!/bin/bash
# bench/packing.py on a GPU machine (issue 35 items 1 and 2): the torch engine's forward_backward over
# 16 datums of lengths uniform 64-2048, padded vs packed micro-batches, at Qwen3-1.7B's and 8B's shapes
# (random-initialised, bf16, LoRA rank 32 on every target, lm_head included), and the output layer's
# target logprobs over 16384 tokens, full logits vs chunked. Nothing but the device's python3 with torch,
# transformers and peft; through the device tool, no carry needed:
#   bash bench/gpu/packing.sh [shapes=1.7b,8b] [reps=5]
# KERNELS=liger adds the padded and packed cases with Liger's fused kernels (TB_ENGINE_KERNELS=liger):
# carry var/carry-snapshot (`bash bench/gpu/snapshot_cost.sh prepare`), whose liger-kernel and peft
# wheels are installed first.
# The packed rows run on a variable-length kernel (packing.flash_available): flash-attn's when
# `import flash_attn` works on the device, else torch's own varlen_attn (tinker_engine/varlen.py);
# with neither, on SDPA with a dense block-diagonal mask, which the output says (the engine's
# TB_ENGINE_LAYOUT=auto would then pick padded). A wheel put in .carry-fa/
# (built for the device's torch and CUDA) is installed first.
# CPU smoke test: DEVICE=cpu TB_PYTHON=.venv/bin/python bash bench/gpu/packing.sh tiny 1
set -euo pipefail
cd "$(dirname "$0")/../.."
SHAPES=${1:-1.7b,8b}
REPS=${2:-5}
DEVICE=${DEVICE:-cuda}
PY=${TB_PYTHON:-python3}
stamp() { echo "[$(date -u +%H:%M:%S)] $*"; }

if [ -n "${KERNELS:-}" ] && compgen -G "var/carry-snapshot/whl/*.whl" > /dev/null; then
  $PY -m pip install -q --no-index --no-deps --target /tmp/pk-site var/carry-snapshot/whl/*.whl && export PYTHONPATH=/tmp/pk-site${PYTHONPATH:+:$PYTHONPATH}
fi
if compgen -G ".carry-fa/*.whl" > /dev/null; then
  $PY -m pip install -q --no-index --no-deps --target /tmp/fa-site .carry-fa/*.whl && export PYTHONPATH=/tmp/fa-site${PYTHONPATH:+:$PYTHONPATH}
fi
stamp "versions"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || echo "no nvidia-smi"
$PY -c "import torch, transformers, peft; print('torch', torch.__version__, 'transformers', transformers.__version__, 'peft', peft.__version__)"
$PY -c "import flash_attn; print('flash-attn', flash_attn.__version__, '(packed rows: its variable-length kernel)')" 2>/dev/null \
  || $PY -c "from torch.nn.attention.varlen import varlen_attn; import inspect; print('flash-attn not installed; packed rows: torch varlen_attn', inspect.signature(varlen_attn))" 2>/dev/null \
  || echo "flash-attn not installed, no torch varlen_attn (packed rows: SDPA with a dense block-diagonal mask)"

for shape in ${SHAPES//,/ }; do
  stamp "bench/packing.py: Qwen3 $shape shape on $DEVICE"
  $PY bench/packing.py --model "$shape" --device "$DEVICE" --reps "$REPS" --warmup 2 --kernels "${KERNELS:-none}" || stamp "$shape: the bench failed (exit $?)"
done
stamp "done"
