#!/usr/bin/env bash
# Runs the engine's pytest tests with the project's virtual environment.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHONPATH=workers/python exec .venv/bin/python -m pytest workers/python/tests -q "$@"
