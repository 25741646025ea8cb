#!/usr/bin/env bash
# The whole test suite on a fresh machine: starts Redis if none answers on 127.0.0.1:6379,
# installs what the tests need (scripts/setup.sh, scripts/setup-vllm.sh), then runs type checking, the engine's
# pytest tests, the mocha tests against real Redis and the real engine, and the end-to-end
# tests with the real Tinker SDK. Ends with a table per run and one summary line: "tests: N passed, M failed, K skipped".
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

bash scripts/setup.sh || { echo "tests: 0 passed, 1 failed, 0 skipped"; exit 1; }
# vLLM for the CPU (about 2 minutes the first time): test/e2e/vllm.test.ts drives it for real.
bash scripts/setup-vllm.sh || { echo "tests: 0 passed, 1 failed, 0 skipped"; exit 1; }

export TB_LOG_LEVEL="${TB_LOG_LEVEL:-warn}"
# Each run's counts from its own output: pytest's summary ("N passed, N failed, N skipped, N errors")
# and mocha's ("N passing", "N failing", "N pending"). A run that failed without a count of failures
# (it errored before its tests, e.g. tsc, a collection error or a hook outside a suite) counts as one failure.
report=$(mktemp)
status=0
count() { grep -Eo "([0-9]+) ($2)" "$1" | awk '{s+=$1} END {print s+0}'; }
run() {
  local name="$1"; shift
  local log; log=$(mktemp)
  "$@" 2>&1 | tee "$log"; local rc=${PIPESTATUS[0]}
  local p f s e
  if [ "$name" = tsc ]; then p=0; f=0; s=0; else
    # Only the summary lines count: pytest's last line, mocha's "N passing/failing/pending" lines.
    if grep -Eq '^ *[0-9]+ passing' "$log"; then
      p=$(grep -E '^ *[0-9]+ passing' "$log" | count /dev/stdin passing)
      f=$(grep -E '^ *[0-9]+ failing' "$log" | count /dev/stdin failing)
      s=$(grep -E '^ *[0-9]+ pending' "$log" | count /dev/stdin pending)
    else
      local sum; sum=$(grep -E '(passed|failed|error|skipped).* in [0-9.]+s' "$log" | tail -1)
      p=$(echo "$sum" | count /dev/stdin passed); f=$(echo "$sum" | count /dev/stdin 'failed|errors?')
      s=$(echo "$sum" | count /dev/stdin skipped)
    fi
  fi
  e=0
  if [ "$rc" -ne 0 ]; then status=1; [ "$f" -eq 0 ] && e=1; fi
  echo "$name $p $f $s $e" >> "$report"
  rm -f "$log"
}
run tsc npx tsc --noEmit
run pytest-pinned env TB_PYTEST_PASS=pinned bash scripts/pytest.sh
run pytest-lowest env TB_PYTEST_PASS=lowest bash scripts/pytest.sh
run mocha npx mocha
run mocha-e2e npx mocha --config test/e2e/.mocharc.json

echo
printf '%-16s %8s %8s %8s %8s\n' run passed failed skipped errored
awk '{printf "%-16s %8d %8d %8d %8d\n", $1, $2, $3, $4, $5}' "$report"
passed=$(awk '{s+=$2} END {print s+0}' "$report")
failed=$(awk '{s+=$3+$5} END {print s+0}' "$report")
skipped=$(awk '{s+=$4} END {print s+0}' "$report")
rm -f "$report"
echo "tests: ${passed} passed, ${failed} failed, ${skipped} skipped"
exit $status
