#!/usr/bin/env bash
# The whole test suite on a fresh machine: starts Redis if none answers on 127.0.0.1:6379,
# installs what the tests need (apt packages, scripts/setup.sh, scripts/setup-vllm.sh; an install
# that fails ends the run as failed), then runs type checking, the engine's pytest tests (pinned and
# lowest versions), the mocha tests against real Redis and the real engine, and the end-to-end tests
# with the real Tinker SDK. Ends with the counts per suite and per run (scripts/test_report.py, from
# each runner's machine-readable results) and one summary line: "tests: N passed, M failed, K skipped".
#
# TB_REQUIRE_TEST_DEPS=1 (set here unless given): a test whose dependency is missing (Chromium,
# vLLM, Docker) fails instead of skipping, since this script installs them.
# For a narrower run: TB_TEST_SPEC="test/api.test.ts workers/python/tests/test_flat.py" runs only
# those files (mocha, mocha-e2e or both pytest passes, by folder; no tsc), and TB_TEST_SETUP=0 skips
# Redis and the installs.
set -uo pipefail
cd "$(dirname "$0")/.."

setup_failed() {
  echo "scripts/test.sh: $1" >&2
  echo "tests: 0 passed, 1 failed, 0 skipped"
  exit 1
}

apt_updated=0
# apt_install PACKAGE WHAT: installs a Debian package; a failure ends the run.
apt_install() {
  echo "scripts/test.sh: installing $1 (for $2)"
  if [ "$apt_updated" = 0 ]; then
    apt-get update -qq || setup_failed "apt-get update failed; $2 needs $1"
    apt_updated=1
  fi
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$1" >/dev/null || setup_failed "apt-get install $1 failed; $2 needs it"
}

if [ "${TB_TEST_SETUP:-1}" != 0 ]; then
  if ! (exec 3<>/dev/tcp/127.0.0.1/6379) 2>/dev/null; then
    command -v redis-server >/dev/null || apt_install redis-server "the tests' Redis"
    redis-server --daemonize yes --bind 127.0.0.1 --port 6379 --save "" --appendonly no --logfile /tmp/tinker-broker-redis.log ||
      setup_failed "redis-server did not start (see /tmp/tinker-broker-redis.log)"
    for _ in $(seq 50); do (exec 3<>/dev/tcp/127.0.0.1/6379) 2>/dev/null && break; sleep 0.1; done
    (exec 3<>/dev/tcp/127.0.0.1/6379) 2>/dev/null || setup_failed "Redis does not answer on 127.0.0.1:6379 (see /tmp/tinker-broker-redis.log)"
  fi

  # The compose tests validate docker-compose.yml with `docker compose config` or docker-compose; they then
  # build the image and run the stack in containers (scripts/docker-ensure.sh installs and starts Docker).
  if ! docker compose version >/dev/null 2>&1 && ! command -v docker-compose >/dev/null; then
    apt_install docker-compose "the compose tests (test/e2e/compose.test.ts)"
  fi

  # The dashboard test (test/e2e/operations.test.ts) loads /admin in headless Chromium.
  if [ ! -x /usr/bin/chromium ]; then
    apt_install chromium "the dashboard test (test/e2e/operations.test.ts)"
    [ -x /usr/bin/chromium ] || setup_failed "the chromium package left no /usr/bin/chromium"
  fi

  bash scripts/setup.sh || setup_failed "scripts/setup.sh failed"
  # vLLM for the CPU (about 2 minutes the first time): test/e2e/vllm.test.ts drives it for real.
  bash scripts/setup-vllm.sh || setup_failed "scripts/setup-vllm.sh failed"
  # verl and VeOmni for the CPU ranks (about 30 s, var/verlsite and var/veomnisite): test/e2e/verl-ranks.test.ts.
  bash scripts/setup-verl.sh --veomni || setup_failed "scripts/setup-verl.sh failed"
fi

export TB_LOG_LEVEL="${TB_LOG_LEVEL:-warn}"
export TB_REQUIRE_TEST_DEPS="${TB_REQUIRE_TEST_DEPS:-1}"

results=$(mktemp -d)
trap 'rm -rf "$results"' EXIT
runs=()
# run NAME COMMAND...: runs it with its output as it comes; its exit status goes to $results/NAME.rc.
run() {
  local name="$1"; shift
  runs+=("$name")
  "$@"
  echo $? >"$results/$name.rc"
}
# Mocha with its spec output and the JSON of scripts/mocha-report.cjs.
mocha_run() {
  local name="$1"; shift
  run "$name" npx mocha --reporter scripts/mocha-report.cjs --reporter-option "json=$results/$name.json" "$@"
}
# A mocha config file: CONFIG with its spec replaced by the files given (mocha adds files named
# on its command line to the config's spec instead).
mocha_config() {
  local out="$results/$(basename "$1" .json).$RANDOM.json"
  node -e 'const fs = require("node:fs"); const [from, to, ...spec] = process.argv.slice(1);
    fs.writeFileSync(to, JSON.stringify({ ...JSON.parse(fs.readFileSync(from, "utf8")), spec }));' "$1" "$out" "${@:2}"
  echo "$out"
}
pytest_run() {
  local pass="$1"; shift
  run "pytest-$pass" env TB_PYTEST_PASS="$pass" bash scripts/pytest.sh --continue-on-collection-errors \
    --junitxml="$results/pytest-$pass.xml" -o junit_family=xunit1 "$@"
}

if [ -z "${TB_TEST_SPEC:-}" ]; then
  run tsc npx tsc --noEmit
  pytest_run pinned
  pytest_run lowest
  mocha_run mocha
  mocha_run mocha-e2e --config test/e2e/.mocharc.json
else
  unit=() e2e=() py=()
  for f in $TB_TEST_SPEC; do
    case "$f" in
      test/e2e/*) e2e+=("$f") ;;
      test/*) unit+=("$f") ;;
      workers/python/tests*) py+=("$f") ;;
      *) setup_failed "TB_TEST_SPEC: $f is not under test/, test/e2e/ or workers/python/tests/" ;;
    esac
  done
  if [ ${#py[@]} -gt 0 ]; then pytest_run pinned "${py[@]}"; pytest_run lowest "${py[@]}"; fi
  if [ ${#unit[@]} -gt 0 ]; then mocha_run mocha --config "$(mocha_config .mocharc.json "${unit[@]}")"; fi
  if [ ${#e2e[@]} -gt 0 ]; then mocha_run mocha-e2e --config "$(mocha_config test/e2e/.mocharc.json "${e2e[@]}")"; fi
fi

# The report; its last line is the summary line. Should it fail, the run fails.
python3 scripts/test_report.py "$results" "${runs[@]}" | tee "$results/report.txt"
status=${PIPESTATUS[0]}
if ! tail -n 1 "$results/report.txt" | grep -Eq '^tests: [0-9]+ passed, [0-9]+ failed, [0-9]+ skipped$'; then
  echo "scripts/test.sh: scripts/test_report.py failed (exit $status)" >&2
  echo "tests: 0 passed, 1 failed, 0 skipped"
  exit 1
fi
exit "$status"
