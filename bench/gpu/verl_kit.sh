# Sourced by bench/gpu/verl_check.sh and bench/gpu/verl_levers.sh on the GPU machine: installs the verl
# wheel kit of bench/gpu/build_verl_carry.sh (carried as $KIT, default .verlcarry; the VeOmni kit of
# bench/gpu/build_veomni_carry.sh too where it was carried as .veomnicarry) into /tmp/site, puts it on
# PYTHONPATH, and checks that verl's Tinker worker imports. Expects $PY (the python to run).
KIT="${VERL_KIT:-.verlcarry}"
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
