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
PY="${PYTHON:-python3}"
[ -x .venv/bin/python ] && [ -z "${PYTHON:-}" ] && [[ " $* " == *" --cpu "* ]] && PY=.venv/bin/python
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS="${OMP_NUM_THREADS:-4}" HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
if [[ " $* " != *" --cpu "* ]]; then
  source bench/gpu/verl_kit.sh || exit 1
fi
timeout "${VERL_CHECK_TIMEOUT:-450}" "$PY" bench/gpu/verl_check.py --out "$OUT" "$@" 2>&1 | tee "$OUT/log.txt"
rc=${PIPESTATUS[0]}
if [ -n "$(command -v nvidia-smi)" ]; then nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader; fi
echo "[verl_check] exit $rc; files in $OUT: $(ls "$OUT" | tr '\n' ' ')"
exit "$rc"
