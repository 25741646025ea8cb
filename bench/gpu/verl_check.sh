#!/usr/bin/env bash
# The verl engine on the H200, against the torch engine (bench/gpu/verl_check.py says what it checks).
#
# On the GPU machine (Python 3.12, torch 2.11, transformers 5.17, peft 0.21; no network), from the
# repository root, with the wheel kit of bench/gpu/build_verl_carry.sh carried as .verlcarry:
#   bash bench/gpu/verl_check.sh [verl_check.py options]
# It installs the kit into /tmp/site, checks verl imports, then runs the comparison (Qwen3-0.6B
# dimensions, random weights) and writes summary.json, verl_fixtures.json, log.txt and both
# engines' logs into $OUT. TB_VERL_STRATEGY=veomni runs verl's VeOmni engine (the VeOmni kit of
# bench/gpu/build_veomni_carry.sh carried as .veomnicarry). Here, without a GPU, `bash bench/gpu/verl_check.sh --cpu` checks the
# driver with the tiny model and a second torch engine in the verl engine's place (no kit needed).
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT="${OUT:-/tmp/verl_check_out}"
mkdir -p "$OUT"
KIT="${VERL_KIT:-.verlcarry}"
PY="${PYTHON:-python3}"
[ -x .venv/bin/python ] && [ -z "${PYTHON:-}" ] && [[ " $* " == *" --cpu "* ]] && PY=.venv/bin/python
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS="${OMP_NUM_THREADS:-4}" HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
if [[ " $* " != *" --cpu "* ]]; then
  t=$(date +%s)
  # The VeOmni kit (bench/gpu/build_veomni_carry.sh) too when it was carried: TB_VERL_STRATEGY=veomni needs it.
  VEOMNI_KIT="${VEOMNI_KIT:-.veomnicarry}"
  EXTRA_WHEELS=(); compgen -G "$VEOMNI_KIT/*.whl" > /dev/null && EXTRA_WHEELS=("$VEOMNI_KIT"/*.whl)
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$KIT"/*.whl "${EXTRA_WHEELS[@]}" \
    || { echo "[kit] pip install failed"; exit 1; }
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
  echo "[kit] $(ls "$KIT"/*.whl | wc -l) wheels installed in $(( $(date +%s) - t ))s"
  "$PY" - <<'PYEOF' || exit 1
import importlib, time
t = time.time()
import torch, transformers, peft
import os, verl, tensordict
from verl.workers.engine_workers_tinker import TinkerTrainingWorker  # noqa: F401
if os.environ.get("TB_VERL_STRATEGY") == "veomni":
    import veomni
    print(f"[kit] veomni {veomni.__version__}")
print(f"[kit] torch {torch.__version__} cuda {torch.cuda.is_available()} ({torch.cuda.device_count()} GPUs) "
      f"transformers {transformers.__version__} peft {peft.__version__} verl {verl.__version__} "
      f"tensordict {tensordict.__version__}; imports {time.time() - t:.1f}s")
PYEOF
fi
timeout "${VERL_CHECK_TIMEOUT:-450}" "$PY" bench/gpu/verl_check.py --out "$OUT" "$@" 2>&1 | tee "$OUT/log.txt"
rc=${PIPESTATUS[0]}
if [ -n "$(command -v nvidia-smi)" ]; then nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader; fi
echo "[verl_check] exit $rc; files in $OUT: $(ls "$OUT" | tr '\n' ' ')"
exit "$rc"
