#!/usr/bin/env bash
# Installs everything tinker-broker needs on a fresh machine: Node packages, a Python
# virtual environment (.venv) with the engine's and the end-to-end tests' pinned
# requirements (and the engine's lowest supported ones in .venv/lowest), and the tiny local model
# (models/tiny-qwen3). Safe to run again.
set -euo pipefail
cd "$(dirname "$0")/.."

if [ ! -d node_modules ] || [ package-lock.json -nt node_modules/.package-lock.json ]; then
  npm ci --no-audit --no-fund
fi

PY="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
# torch first, pinned: the CPU build; an unpinned torch would pull a multi-GB CUDA build.
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
  .venv/bin/pip install --quiet --disable-pip-version-check "$(grep '^torch==' workers/python/requirements.txt)"
fi
.venv/bin/pip install --quiet --disable-pip-version-check -r workers/python/requirements.txt -r test/e2e/requirements.txt
# See test/e2e/requirements.txt for why the cookbook comes without its declared dependencies.
.venv/bin/pip install --quiet --disable-pip-version-check --no-deps tinker-cookbook==0.6.1

# The lowest supported transformers, as an overlay for the engine's second test pass (scripts/pytest.sh).
if ! cmp -s workers/python/requirements-lowest.txt .venv/lowest/.requirements 2>/dev/null; then
  rm -rf .venv/lowest
  .venv/bin/pip install --quiet --disable-pip-version-check --no-deps --target .venv/lowest -r workers/python/requirements-lowest.txt
  cp workers/python/requirements-lowest.txt .venv/lowest/.requirements
fi

.venv/bin/python scripts/make_tiny_model.py --out models/tiny-qwen3
