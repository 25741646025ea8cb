#!/bin/bash
# On the 16-core GPU machine, the figures the CPU here cannot give (2 cores):
#   - issue 37 item 5: two agents serving one model against one agent (bench/scale-out.ts; a small
#     stand-in model, torch engines on the CPU, each agent's engine on 4 of the 16 cores);
#   - issue 36: 32 concurrent one-sample requests against one 32-sample request (bench/sampling.ts
#     ratio), the tiny model on the CPU, then on cuda:0;
#   - issue 36 (when JOINS is set): a burst joining a running generation on cuda:0, in one process and in
#     the engine as a child (bench/sample_joins.py, bench/engine_joins.py);
#   - issue 34 (when MEMBERS is set, e.g. 1,2,4,8): a co-batched pass of N members at the 1.7B shape,
#     in-process (bench/gpu/profile_train.py --members).
# Needs node, redis-server and the production node_modules: either on a warm machine after
# bench/gpu/turns_check.sh or vllm_sdk_check.sh (/tmp/tb), or from var/carry-snapshot
# (`bash bench/gpu/snapshot_cost.sh prepare`), carried:
#   bash bench/gpu/sampling_scale.sh
set -uo pipefail
cd "$(dirname "$0")/../.."
T0=$(date +%s)
stamp() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
if [ -x /tmp/tb/bin/node ]; then
  export PATH=/tmp/tb/bin:$PATH
  [ -d node_modules ] || tar -C . -xJf /tmp/tb/parts/nm.tar.xz
else
  C=var/carry-snapshot; TB=/tmp/tbs; OUT=${OUT:-/tmp}
  source bench/gpu/shape_lib.sh
fi
python3 -c "import socket; socket.create_connection(('127.0.0.1', 6379), 1)" 2>/dev/null \
  || redis-server --port 6379 --save '' --appendonly no --daemonize yes --logfile /tmp/redis-scale.log
sleep 1
export TB_PYTHON=python3 TB_LOG_LEVEL=${TB_LOG_LEVEL:-warn}
nproc
# SCALE_ARGS: bench/scale-out.ts's requests, max_tokens, rounds, threads (several runs: separated by ';').
# SCALE_SHAPE: the model the agents serve: `small` (the default: bench/gpu/engine_vs_plain.py's
# ~26M-parameter stand-in, float32, random weights, so that the engines' decode steps are arithmetic
# rather than per-step Python) or `tiny` (the tiny model). The defaults are the run of 2026-12-07 in
# docs/benchmarks.md ("Two agents serving one model"): bursts of 512 and 1,024 one-sample requests,
# 4 engine threads per agent. At 128 requests a CPU decode step's fixed part (reading the weights,
# per-step Python) is most of a step and does not halve with the rows: two agents gave 1.46x there.
# SCALE_ARGS="" (set and empty): no scale-out run.
SCALE_ARGS=${SCALE_ARGS-512 64 2 4;1024 64 2 4}
SCALE_SHAPE=${SCALE_SHAPE:-small}
if [ "$SCALE_SHAPE" != tiny ]; then
  export SCALE_MODEL=/tmp/scale-model-$SCALE_SHAPE
  [ -f $SCALE_MODEL/config.json ] || python3 -c "import sys, torch; sys.path.insert(0, 'bench/gpu'); from pathlib import Path; from engine_vs_plain import write_model; write_model('$SCALE_SHAPE', Path('$SCALE_MODEL'), torch.device('cpu'), torch.float32)" 2>&1 | grep -v -i warn
fi
# Several runs: SCALE_ARGS separated by ';' (e.g. "256 64 2 4;1024 64 2 4"), each limited to SCALE_S.
IFS=';' read -ra SCALE_RUNS <<< "$SCALE_ARGS"
for args in "${SCALE_RUNS[@]}"; do
  stamp "bench/scale-out.ts $args (shape $SCALE_SHAPE)"
  timeout ${SCALE_S:-280} node --import tsx bench/scale-out.ts $args
done
# RATIO_ARGS: bench/sampling.ts ratio's n, max_tokens, prompt_len, rounds (several: separated by ';'),
# each run with the engine on the CPU (7 threads), then on cuda:0. A burst's fixed costs (the client's
# and the API's per request) weigh less as the generation grows.
# RATIO_DEVICES: the engine devices of those runs ("cpu cuda:0").
[ -n "${SKIP_RATIO:-}" ] || {
IFS=';' read -ra RATIO_RUNS <<< "${RATIO_ARGS:-32 64 16 3;32 512 16 3}"
for args in "${RATIO_RUNS[@]}"; do
  for dev in ${RATIO_DEVICES:-cpu cuda:0}; do
    THREADS=(); [ $dev = cpu ] && THREADS=(TB_ENGINE_THREADS=7)
    stamp "bench/sampling.ts ratio $args (tiny model, engine on $dev ${THREADS[*]})"
    env "${THREADS[@]}" TB_ENGINE_DEVICE=$dev timeout ${RATIO_S:-120} node --import tsx bench/sampling.ts ratio $args
  done
done
}
# JOINS=1: the torch engine's sampler when a burst joins a running generation, on cuda:0 (issue 36: the
# ratio on cuda:0 fell to 0.06-0.07 on 2026-12-07, docs/benchmarks.md): in one process
# (bench/sample_joins.py), then as the agent runs it, a child on its pipes, under cProfile
# (bench/engine_joins.py; the child's 25 costliest functions by own time).
if [ -n "${JOINS:-}" ]; then
  [ -f models/tiny-qwen3/config.json ] || python3 scripts/make_tiny_model.py --out models/tiny-qwen3 >/dev/null 2>&1
  stamp "bench/sample_joins.py on cuda: 1 then 31 joining 20 steps later"
  python3 bench/sample_joins.py --device cuda --rounds 3 --groups 1,31 --every 20 2>&1 | grep -v -i -E "warn|Loading"
  stamp "bench/sample_joins.py on cuda: the same, joining at another step each round (shapes not seen before)"
  python3 bench/sample_joins.py --device cuda --rounds 3 --groups 1,31 --every 7 --vary 2>&1 | grep -v -i -E "warn|Loading"
  stamp "the same with cuDNN's attention left in (torch's own order; the engine leaves it out since 2026-12-07)"
  python3 bench/sample_joins.py --device cuda --rounds 3 --groups 1,31 --every 7 --vary --cudnn-attention 2>&1 | grep -v -i -E "warn|Loading"
  # The agent reads its engine's GPU memory with nvidia-smi at every heartbeat (workers/stats.ts): how long one takes here.
  nvidia-smi -q | grep -i -m1 persistence; stamp "nvidia-smi --query-compute-apps"; nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader; stamp "done"
  stamp "bench/engine_joins.py on cuda (the engine as a child, under cProfile)"
  python3 bench/engine_joins.py --device cuda --rounds 4 --gap-ms 30 --profile /tmp/engine-joins.prof 2>&1 | grep -v -E "INFO|Loading|[Ww]arn"
  python3 -c "import pstats; pstats.Stats('/tmp/engine-joins.prof').sort_stats('tottime').print_stats(25)" | tail -34 | cut -c1-200
fi
if [ -n "${MEMBERS:-}" ]; then
  stamp "profile_train.py --members $MEMBERS (1.7B shape, 2 x 256 tokens per member)"
  timeout ${MEMBERS_S:-150} python3 bench/gpu/profile_train.py --model 1.7b --batch 2 --seq 256 --steps 5 --members "$MEMBERS" 2>&1 | grep -v -i warn | head -60
fi
stamp "done"
