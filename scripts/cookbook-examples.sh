#!/usr/bin/env bash
# Runs a Tinker Cookbook (0.6.1) recipe, unchanged, against a running tinker-broker server, with
# the tiny local model, a few steps, and local data (no hub access):
#
#   scripts/cookbook-examples.sh <recipe> [key=value ...]     # the recipe's own chz arguments
#   scripts/cookbook-examples.sh --list
#
# recipes: chat_sl sl_loop rl_loop math_rl math_rl_ppo dpo distill_on_policy
#          distill_multi_teacher distill_off_policy_topk arithmetic_sft math_rl_from_sft
#          sft_then_rl rl_loop_sft rl_loop_from_sft (resume_from=<state_path> of rl_loop_sft)
#
# The server is TINKER_BASE_URL (default http://127.0.0.1:8000, key TINKER_API_KEY, default
# tml-local). The distillation recipes need a teacher served by name, and sl_loop/rl_loop the tiny
# model under the hub name Qwen/Qwen3-8B-Base; the preset presets/cpu/cookbook.yaml serves them all:
#
#   npm start -- --preset presets/cpu/cookbook.yaml
#
# Data and runs go to var/cookbook (--workdir DIR to change): each recipe's metrics are in
# var/cookbook/runs/<recipe>/metrics.jsonl, its console output in var/cookbook/runs/<recipe>.out.
# The last line printed is a JSON summary (commands, metrics rows). Models by environment:
# COOKBOOK_MODEL, COOKBOOK_TEACHER, COOKBOOK_TEACHER2, COOKBOOK_RENDERER (see
# test/e2e/cookbook/run.py).
set -euo pipefail
cd "$(dirname "$0")/.."
export TINKER_BASE_URL="${TINKER_BASE_URL:-http://127.0.0.1:8000}"
export TINKER_API_KEY="${TINKER_API_KEY:-tml-local}"
PY="${PYTHON:-.venv/bin/python}"
if [ "$#" -eq 0 ] || [ "$1" = "-h" ] || [ "$1" = "--help" ]; then
  sed -n '2,22p' "$0" | sed 's/^# \{0,1\}//'
  exit 0
fi
exec "$PY" test/e2e/cookbook/run.py "$@"
