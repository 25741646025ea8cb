#!/usr/bin/env bash
# Installs verl 0.9.1 (and with --veomni VeOmni 0.1.12) for the verl engine on this machine's CPU (test/e2e/verl-ranks.test.ts,
# docs/engines/verl.md): verl and what it imports that .venv lacks, --no-deps, into a directory of
# its own (default var/verlsite, git-ignored) that the agent's engine gets on its PYTHONPATH, so
# .venv keeps its own versions (hydra's antlr4 4.9.3 would replace .venv's 4.13). Pinned as the
# GPU kit is (bench/gpu/build_verl_carry.sh); packages .venv already has (tensordict 0.10.0,
# pydantic, datasets, …) come from .venv. Needs network (a package index). About 250 MB, ~30 s.
set -euo pipefail
cd "$(dirname "$0")/.."
VEOMNI=0; [ "${1:-}" = --veomni ] && { VEOMNI=1; shift; }
OUT="${1:-var/verlsite}"
PY="${PYTHON:-.venv/bin/python}"
mkdir -p "$OUT"
"$PY" -m pip install -q --no-deps --target "$OUT" \
  verl==0.9.1 ray==2.55.1 hydra-core==1.3.2 omegaconf==2.3.0 antlr4-python3-runtime==4.9.3 codetiming==1.4.0 \
  torchdata==0.11.0 jsonschema==4.25.1 referencing==0.36.2 rpds-py==0.27.1 jsonschema-specifications==2025.9.1 \
  fastapi==0.116.1 starlette==0.47.2 uvicorn==0.35.0 msgpack==1.2.4
PYTHONPATH="$OUT" "$PY" -c "import verl, tensordict; from verl.workers.engine_workers_tinker import TinkerTrainingWorker; print('verl', verl.__version__, 'tensordict', tensordict.__version__)" 2>/dev/null
echo "done: PYTHONPATH=$OUT"
# --veomni: VeOmni 0.1.12 (verl's strategy veomni) into var/veomnisite, with the transformers it imports:
# .venv's 5.24 no longer has Qwen2_5OmniThinkerCausalLMOutputWithPast, which veomni imports at load;
# 5.17.0 (what the H200 run had) needs huggingface-hub < 2 (1.33.0 has what .venv's datasets imports).
# Only a VeOmni agent gets this directory on its PYTHONPATH (before verl's).
if [ "$VEOMNI" = 1 ]; then
  V=var/veomnisite
  mkdir -p "$V"
  "$PY" -m pip install -q --no-deps --target "$V" veomni==0.1.12 transformers==5.17.0 huggingface-hub==1.33.0
  PYTHONPATH="$V:$OUT" "$PY" -c "import veomni, transformers; print('veomni', veomni.__version__, 'transformers', transformers.__version__)" 2>/dev/null
  echo "done: PYTHONPATH=$V:$OUT for a VeOmni agent"
fi
