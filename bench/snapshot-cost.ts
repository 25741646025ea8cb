import { readdir, stat } from 'node:fs/promises';
import path from 'node:path';
import { parseArgs } from 'node:util';
import { Redis } from 'ioredis';
import { Names } from '../queues/contract/names.js';
import { TINY_MODEL_ALIAS } from '../scripts/stack.js';
import { E2EServer } from '../test/e2e/server.js';
import { REDIS_URL } from '../test/helpers/stack.js';
import { encodeForwardBackward } from '../test/helpers/wire.js';
import { latestSnapshot, snapshotRoot } from '../workers/snapshots.js';
import { BENCH_ADAM, benchBatch, post, result, runBench } from './client.js';

/**
 * What continuous snapshots cost a training loop (workers/snapshots.ts): the start command as a
 * user starts it, one client running forward_backward + optim_step steps (each op awaited), with a
 * snapshot after every optim_step (TB_SNAPSHOT_EVERY_STEPS=1, the default) against none
 * (TB_SNAPSHOT_EVERY_STEPS=0). The two run alternately, `rounds` times each, on fresh servers;
 * it prints each round's median step time and the ratio of the medians over all rounds.
 *
 *   node --import tsx bench/snapshot-cost.ts [steps=100] [rounds=3] [rank=8] [seqLen=32] [batch=2]
 *     [--model DIR] [--device cpu|cuda] [--warmup 5]
 *
 * - `--model DIR`: the base model served (TB_AGENT_MODELS, alias `snapshot-bench`) instead of the
 *   default preset's tiny model; `--device`: the engine's device (TB_ENGINE_DEVICE; unset: the
 *   preset's, cpu). On the H200: bench/gpu/snapshot_cost.sh.
 * - The batch is `batch` sequences of `seqLen` tokens (bench/client.ts benchBatch's two, repeated).
 *
 * How long a snapshot holds the op stream: the agent runs it after the optim_step, before the
 * next op takes the engine, so the optim_step's engine span in its outcome record (Redis) covers
 * both. The bench prints those spans with and without snapshots, their difference per step (the
 * next op's delay: the copy, and what the previous snapshot's writer thread took from the step),
 * and the forward_backward spans (the writer thread works while they run). With TB_LOG_LEVEL=info the
 * engine's own line per op reaches the server's log, and the bench also prints the engine's time
 * for each snapshot_state (the state's copy to CPU memory).
 */
const cli = parseArgs({
  allowPositionals: true,
  options: { model: { type: 'string' }, device: { type: 'string' }, warmup: { type: 'string', default: '5' } },
});
const [steps, rounds, rank, seqLen, batchSize] = [100, 3, 8, 32, 2].map((d, i) => Number(cli.positionals[i] ?? d)) as [number, number, number, number, number];
const warmup = Number(cli.values.warmup);
for (const [name, v] of Object.entries({ steps, rounds, rank, seqLen, batch: batchSize, warmup }))
  if (!Number.isInteger(v) || v < (name === 'warmup' ? 0 : 1)) throw new Error(`${name} must be a whole number${name === 'warmup' ? '' : ' above 0'}, got ${v}`);
const BENCH_ALIAS = 'snapshot-bench';
const baseModel = cli.values.model ? BENCH_ALIAS : TINY_MODEL_ALIAS;
const serverEnv: NodeJS.ProcessEnv = {
  TB_LONG_POLL_MS: '25000',
  // The outcome records are read after the run: kept that long after their futures were read.
  TB_RESULT_TTL_AFTER_READ_S: '3600',
  ...(cli.values.model ? { TB_AGENT_MODELS: `${path.resolve(cli.values.model)}=${BENCH_ALIAS}` } : {}),
  ...(cli.values.device ? { TB_ENGINE_DEVICE: cli.values.device } : {}),
};
const batch = Array.from({ length: Math.ceil(batchSize / 2) }, () => benchBatch(seqLen))
  .flat()
  .slice(0, batchSize);

/** One run's figures (ms): each timed step as the client saw it, the engine spans of its ops, and the engine's own snapshot_state times (empty unless its log reached the server's). */
type Run = { step: number[]; fb: number[]; optim: number[]; snapshot: number[]; snapshotBytes: number | null };

async function run(everySteps: number): Promise<Run> {
  const server = new E2EServer({ ...serverEnv, TB_SNAPSHOT_EVERY_STEPS: String(everySteps) });
  try {
    await server.start(600_000);
    const base = server.baseUrl;
    const session = (await post(base, '/create_session', { tags: [], user_metadata: {}, sdk_version: '0.38.0', type: 'create_session' })).session_id;
    const cm = await post(base, '/create_model', { session_id: session, model_seq_id: 0, base_model: baseModel, lora_config: { rank, seed: 0 } });
    const modelId = (await result(base, cm.request_id)).model_id as string;
    let seq = 1;
    const step = async (): Promise<[fb: string, optim: string]> => {
      const fb = await post(base, '/forward_backward', undefined, encodeForwardBackward({ modelId, seqId: seq++, data: batch }));
      await result(base, fb.request_id);
      const opt = await post(base, '/optim_step', { model_id: modelId, seq_id: seq++, adam_params: BENCH_ADAM });
      await result(base, opt.request_id);
      return [fb.request_id, opt.request_id];
    };
    for (let i = 0; i < warmup; i++) await step();
    const times: number[] = [];
    const ids: [string, string][] = [];
    for (let i = 0; i < steps; i++) {
      const t = performance.now();
      ids.push(await step());
      times.push(performance.now() - t);
    }
    const spans = await engineSpans(server.prefix, ids.flat());
    // The engine's line per op (`op=snapshot_state model_id=… ms=12.3 ok`), the timed steps' being the last ones.
    const snapshot = [...server.log.matchAll(/op=snapshot_state\b.*?\bms=([\d.]+) ok/g)].map((m) => Number(m[1])).slice(-steps);
    return { step: times, fb: spans.filter((_, i) => i % 2 === 0), optim: spans.filter((_, i) => i % 2 === 1), snapshot, snapshotBytes: await snapshotBytes(server.storage, modelId) };
  } finally {
    await server.destroy();
  }
}

/** Each op's engine span (its outcome record's `engine`: start to end of the agent's engine call, a snapshot after an optim_step included), in ms. */
async function engineSpans(prefix: string, requestIds: string[]): Promise<number[]> {
  const names = new Names(prefix);
  const redis = new Redis(REDIS_URL);
  try {
    const recs = await redis.mget(requestIds.map((id) => names.outcome(id.split('/')[1]!)));
    return recs.map((rec, i) => {
      const engine = rec ? (JSON.parse(rec) as { engine?: [number, number] }).engine : undefined;
      if (!engine) throw new Error(`no engine span recorded for ${requestIds[i]}`);
      return engine[1] - engine[0];
    });
  } finally {
    redis.disconnect();
  }
}

/** The size of the model's newest complete snapshot on disk (its adapter and AdamW state), or null without one. */
async function snapshotBytes(storageDir: string, modelId: string): Promise<number | null> {
  const snap = await latestSnapshot(snapshotRoot(storageDir, modelId));
  if (!snap) return null;
  let n = 0;
  for (const f of await readdir(snap.dir)) n += (await stat(path.join(snap.dir, f))).size;
  return n;
}

function pct(xs: number[], p: number): number {
  const s = [...xs].sort((a, b) => a - b);
  return s[Math.min(s.length - 1, Math.floor(p * s.length))]!;
}
const median = (xs: number[]) => pct(xs, 0.5);
const dist = (xs: number[]) => (xs.length ? `${[0.5, 0.9, 1].map((p) => pct(xs, p).toFixed(1)).join(' / ')} ms` : '-');

runBench(async () => {
  const on: Run[] = [];
  const off: Run[] = [];
  console.log(
    `model ${cli.values.model ? path.resolve(cli.values.model) : TINY_MODEL_ALIAS}, device ${cli.values.device ?? process.env.TB_ENGINE_DEVICE ?? "the preset's"}, ` +
      `rank ${rank}, batch ${batchSize} x ${seqLen} tokens, ${warmup} warm-up + ${steps} timed steps per run, ${rounds} rounds`,
  );
  for (let r = 0; r < rounds; r++) {
    off.push(await run(0));
    on.push(await run(1));
    const w = on.at(-1)!;
    const wo = off.at(-1)!;
    console.log(`round ${r + 1}: step p50 without snapshots ${median(wo.step).toFixed(2)} ms, with a snapshot every step ${median(w.step).toFixed(2)} ms`);
    console.log(
      `  optim_step engine span p50 without ${median(wo.optim).toFixed(2)} ms, with (its snapshot included) ${median(w.optim).toFixed(2)} ms` +
        (w.snapshot.length ? `; the engine's snapshot_state p50 / p90 / max ${dist(w.snapshot)}` : ''),
    );
  }
  const all = (runs: Run[], k: 'step' | 'fb' | 'optim' | 'snapshot') => runs.flatMap((x) => x[k]);
  const [mOn, mOff] = [median(all(on, 'step')), median(all(off, 'step'))];
  // Medians of the rounds' medians, as before.
  const [rOn, rOff] = [median(on.map((x) => median(x.step))), median(off.map((x) => median(x.step)))];
  console.log(`steps=${steps} rounds=${rounds} rank=${rank} seqLen=${seqLen} batch=${batchSize}: with/without = ${(rOn / rOff).toFixed(3)} (medians ${rOn.toFixed(2)} / ${rOff.toFixed(2)} ms)`);
  console.log(`all timed steps of all rounds, p50 / p90 / max: without ${dist(all(off, 'step'))}, with ${dist(all(on, 'step'))} (medians' ratio ${(mOn / mOff).toFixed(3)})`);
  console.log(`engine spans, p50 / p90 / max over all rounds:`);
  console.log(`  forward_backward: without ${dist(all(off, 'fb'))}, with ${dist(all(on, 'fb'))}`);
  console.log(`  optim_step:       without ${dist(all(off, 'optim'))}, with ${dist(all(on, 'optim'))} (its snapshot included)`);
  const optimOff = median(all(off, 'optim'));
  const hold = all(on, 'optim').map((x) => x - optimOff);
  // The snapshot's copy, plus whatever the previous snapshot's writer thread took from the optim_step itself.
  console.log(`the next op's delay by a snapshot (each optim_step span with, less the median without), p50 / p90 / max: ${dist(hold)}`);
  const snaps = all(on, 'snapshot');
  console.log(
    snaps.length
      ? `the engine's snapshot_state time (the copy to CPU memory), p50 / p90 / max over ${snaps.length} snapshots: ${dist(snaps)}`
      : `the engine's snapshot_state time: not in the server's log (run with TB_LOG_LEVEL=info for it)`,
  );
  const bytes = on.map((x) => x.snapshotBytes).find((b) => b !== null);
  if (bytes != null) console.log(`a snapshot on disk: ${(bytes / 2 ** 20).toFixed(1)} MiB (the adapter and its AdamW state)`);
});
