#!/usr/bin/env bash
# The whole test suite on a fresh machine: starts Redis if none answers on 127.0.0.1:6379,
# installs what the tests need (scripts/setup.sh, scripts/setup-vllm.sh), then runs type checking, the engine's
# pytest tests, the mocha tests against real Redis and the real engine, and the end-to-end
# tests with the real Tinker SDK. Ends with one summary line: "tests: N passed, M failed".
set -uo pipefail
cd "$(dirname "$0")/.."

if ! (exec 3<>/dev/tcp/127.0.0.1/6379) 2>/dev/null; then
  if ! command -v redis-server >/dev/null; then
    apt-get update -qq && apt-get install -y -qq redis-server >/dev/null
  fi
  redis-server --daemonize yes --bind 127.0.0.1 --port 6379 --save "" --appendonly no --logfile /tmp/tinker-broker-redis.log
  for _ in $(seq 50); do (exec 3<>/dev/tcp/127.0.0.1/6379) 2>/dev/null && break; sleep 0.1; done
fi

# The compose tests validate docker-compose.yml with `docker compose config` or docker-compose; they then
# build the image and run the stack in containers (scripts/docker-ensure.sh installs and starts Docker).
if ! docker compose version >/dev/null 2>&1 && ! command -v docker-compose >/dev/null; then
  apt-get update -qq && apt-get install -y -qq docker-compose >/dev/null
fi

# The dashboard test (test/e2e/operations.test.ts) loads /admin in headless Chromium.
if ! command -v chromium >/dev/null; then
  apt-get update -qq && apt-get install -y -qq chromium >/dev/null
fi

bash scripts/setup.sh || { echo "tests: 0 passed, 1 failed"; exit 1; }
# vLLM for the CPU (about 2 minutes the first time): test/e2e/vllm.test.ts drives it for real.
bash scripts/setup-vllm.sh || { echo "tests: 0 passed, 1 failed"; exit 1; }

export TB_LOG_LEVEL="${TB_LOG_LEVEL:-warn}"
log=$(mktemp)
status=0
run() { "$@" 2>&1 | tee -a "$log"; local rc=${PIPESTATUS[0]}; [ "$rc" -eq 0 ] || status=1; }
run npx tsc --noEmit
run bash scripts/pytest.sh
run npx mocha
run npx mocha --config test/e2e/.mocharc.json

# Totals from pytest ("N passed", "N failed") and mocha ("N passing", "N failing").
passed=$(grep -Eo '([0-9]+) (passed|passing)' "$log" | awk '{s+=$1} END {print s+0}')
failed=$(grep -Eo '([0-9]+) (failed|failing)' "$log" | awk '{s+=$1} END {print s+0}')
if [ "$status" -ne 0 ] && [ "$failed" -eq 0 ]; then failed=1; fi
rm -f "$log"
echo "tests: ${passed} passed, ${failed} failed"
exit $status
