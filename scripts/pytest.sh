#!/usr/bin/env bash
# Runs the engine's pytest tests with the project's virtual environment: with the pinned versions
# (workers/python/requirements.txt), then again with the lowest supported ones
# (workers/python/requirements-lowest.txt, the overlay .venv/lowest that scripts/setup.sh installs).
# TB_PYTEST_LOWEST=0 skips the second pass; TB_PYTEST_PASS=pinned or lowest runs only that pass
# (scripts/test.sh runs them apart, to report each). Arguments go to both; arguments that name test
# files or folders (workers/python/tests/test_flat.py, ...::test_name) replace workers/python/tests.
set -euo pipefail
cd "$(dirname "$0")/.."
pass="${TB_PYTEST_PASS:-both}"
paths=(workers/python/tests)
for a in "$@"; do
  if [ -e "${a%%::*}" ]; then paths=(); break; fi
done
if [ "$pass" != lowest ]; then
  PYTHONPATH=workers/python .venv/bin/python -m pytest "${paths[@]}" -q "$@"
fi
if [ "$pass" = lowest ] || { [ "$pass" = both ] && [ "${TB_PYTEST_LOWEST:-1}" != 0 ]; }; then
  if [ ! -d .venv/lowest ]; then
    echo "scripts/pytest.sh: .venv/lowest is missing; run scripts/setup.sh (or TB_PYTEST_LOWEST=0)" >&2
    exit 1
  fi
  echo "== engine tests with the lowest supported versions: $(grep -v '^#' workers/python/requirements-lowest.txt | xargs)"
  PYTHONPATH=.venv/lowest:workers/python .venv/bin/python -m pytest "${paths[@]}" -q "$@"
fi
