import { performance } from 'node:perf_hooks';
import { fileURLToPath } from 'node:url';
import { Job, Queue } from 'bullmq';
import { Redis } from 'ioredis';
import { TINY_MODEL_ALIAS } from '../scripts/stack.js';
import { E2E_KEY, E2EServer } from '../test/e2e/server.js';
import { REDIS_URL } from '../test/helpers/stack.js';
import { encodeForwardBackward } from '../test/helpers/wire.js';
import { BENCH_ADAM, benchBatch, post, result, runBench } from './client.js';
import { floorOverheads } from './floor.js';
import { children, cmdline, cpuMs } from './proc.js';
import { sdkFloor } from './sdk-floor.js';

/**
 * Broker overhead per training op, against the server as a user starts it (`tinker-broker start`:
 * API and agent together in one process apart from the bench's, the torch engine with the tiny model
 * its child, Redis on loopback).
 *
 * Each client owns a model and runs ops one after another, alternating forward_backward (2 × 32
 * tokens) and optim_step; an op is timed from its submit to its result as the client sees them
 * (POST, then retrieve_future). The engine's time comes from the op's own record: the agent stamps
 * when the engine started and ended it (`engine` in the outcome record; a server without those
 * stamps is measured by its BullMQ job's processedOn/finishedOn, which also count the agent's
 * outcome writes around the engine call).
 *
 *   overhead = client-observed time − the op's engine time − the engine time spent on other ops
 *              while it waited (their engine intervals within its submit and its own start,
 *              the op already on the engine at its submit included)
 *
 * With one client the last term is zero: the client's wait minus what the engine spent on its op.
 * With 64 clients on one engine an op queues behind others; their engine time is the engine's, not
 * the broker's, while the engine's idle gaps between them are the broker's: each gap delays every
 * op waiting then, so an op's figure holds the gaps of all the ops it waited behind. The gaps
 * themselves (the engine's idle time between one op's end and the next op's start, while ops
 * wait) are what each op costs the saturated engine: printed as "engine idle between consecutive ops".
 *
 * Then the SDK: `training_client.optim_step(adam).result()` through the real tinker SDK against two
 * plain HTTP round trips to the same server (`GET /api/v1/healthz`, and a 404), interleaved in one
 * Python process (bench/sdk_optim_step.py); and the SDK's floor: the same script against a bare
 * server that answers optim_step and its future at once (bench/sdk-floor.ts), the ratio no server
 * reaches below on this machine.
 *
 * Each run also prints where an op's time goes, stage by stage (see stages()), the CPU time an op
 * costs the server's process, its engine and Redis (from /proc: a figure that a shared machine's
 * noise moves far less than latency), and, with many clients, the engine's idle time between one
 * op's end and the next op's start. After the 1-client
 * run, the floor under it: the same hops (HTTP, one Redis round trip, a pipe to an engine busy as
 * long as that run's ops) with nothing of the broker in them (bench/floor.ts).
 *
 *   node --import tsx bench/overhead.ts [opsPerClient1=200] [opsPerClient64=8] [sdkSteps=100] [--json]
 */
const args = process.argv.slice(2).filter((a) => !a.startsWith('--'));
const json = process.argv.includes('--json');
const ops1 = Number(args[0] ?? 200);
const ops64 = Number(args[1] ?? 8);
const sdkSteps = Number(args[2] ?? 100);

const seqLen = 32;
const batch = benchBatch(seqLen);
const adam = BENCH_ADAM;

const now = () => performance.timeOrigin + performance.now();


type Op = { kind: 'fb' | 'os'; requestId: string; start: number; end: number; engine?: [number, number]; job?: { added: number; processed: number; finished: number } };

async function createModel(base: string, session: string, i: number): Promise<string> {
  const cm = await post(base, '/create_model', { session_id: session, model_seq_id: i, base_model: TINY_MODEL_ALIAS, lora_config: { rank: 8, seed: i } });
  return (await result(base, cm.request_id)).model_id;
}

/** One client: `n` ops on its model from seq_id `from`, each awaited before the next. */
async function client(base: string, modelId: string, from: number, n: number): Promise<Op[]> {
  const out: Op[] = [];
  for (let seq = from; seq < from + n; seq++) {
    const start = now();
    const sub =
      seq % 2 === 1
        ? await post(base, '/forward_backward', undefined, encodeForwardBackward({ modelId, seqId: seq, data: batch }))
        : await post(base, '/optim_step', { model_id: modelId, seq_id: seq, adam_params: adam });
    await result(base, sub.request_id);
    out.push({ kind: seq % 2 === 1 ? 'fb' : 'os', requestId: sub.request_id, start, end: now() });
  }
  return out;
}

/** The engine interval of each op, from its outcome record (or its BullMQ job's timestamps). */
async function engineTimes(redis: Redis, prefix: string, ops: Op[]): Promise<void> {
  const queues = new Map<string, Queue>();
  for (const op of ops) {
    const [queue, jobId] = op.requestId.split('/') as [string, string];
    // An op answered in the agent's process is recorded just after its answer: wait for the record.
    let rec: string | null = null;
    for (let tries = 0; tries < 200; tries++) {
      rec = await redis.get(`${prefix}:outcome:${jobId}`);
      if (rec && !rec.startsWith('{"state":"running"')) break;
      await new Promise((r) => setTimeout(r, 10));
    }
    const engine = rec ? (JSON.parse(rec).engine as [number, number] | undefined) : undefined;
    let q = queues.get(queue);
    if (!q) queues.set(queue, (q = new Queue(queue, { connection: redis, prefix: `${prefix}-bull` })));
    const job = await Job.fromId(q, jobId);
    if (job?.processedOn && job.finishedOn) op.job = { added: job.timestamp, processed: job.processedOn, finished: job.finishedOn };
    if (engine) {
      op.engine = engine;
      continue;
    }
    if (!op.job) throw new Error(`no engine times for ${op.requestId}`);
    op.engine = [op.job.processed, op.job.finished];
  }
  await Promise.all([...queues.values()].map((q) => q.close()));
}

function overheads(ops: Op[]): number[] {
  const byStart = [...ops].sort((a, b) => a.engine![0] - b.engine![0]);
  return ops.map((op) => {
    const [s, e] = op.engine!;
    // The engine's time on other ops within [submit, own start] (one engine: their intervals do not overlap).
    let ahead = 0;
    for (const o of byStart) {
      if (o === op) continue;
      const [os, oe] = o.engine!;
      if (os >= s) break;
      ahead += Math.max(0, Math.min(oe, s) - Math.max(os, op.start));
    }
    return op.end - op.start - (e - s) - ahead;
  });
}

const pct = (xs: number[], p: number) => {
  const s = [...xs].sort((a, b) => a - b);
  return s[Math.min(s.length - 1, Math.floor(p * s.length))]!;
};

/**
 * Where one op's time goes, p50 of each stage (ms; BullMQ stamps are whole milliseconds):
 * submit (client start → job added: HTTP, API, up to the gate's script), pickup (added → the agent
 * took it: 0 when the submit's script took it for the agent in the API's process, whose time stamps
 * are both the submit's), before (taken → engine start: the take's or the submit script's round
 * trip, the agent's claim and checks), engine, after (engine end → job finished: with the API in the
 * agent's process the answer, then the outcome record, then the BullMQ end), reply (finished → the
 * client has the result: with the API in another process the signal, retrieve_future and HTTP; in
 * the same process the answer went out before the job finished, so it is near 0 or negative).
 */
function stages(ops: Op[]): Record<string, number> | null {
  const timed = ops.filter((o) => o.job && o.engine);
  if (!timed.length) return null;
  const of = (f: (o: Op) => number) => pct(timed.map(f), 0.5);
  return {
    submit: of((o) => o.job!.added - o.start),
    pickup: of((o) => o.job!.processed - o.job!.added),
    before: of((o) => o.engine![0] - o.job!.processed),
    engine: of((o) => o.engine![1] - o.engine![0]),
    after: of((o) => o.job!.finished - o.engine![1]),
    reply: of((o) => o.end - o.job!.finished),
  };
}

type Figures = {
  clients: number;
  ops: number;
  p50: number;
  p99: number;
  engineP50: number;
  engineFbP50: number;
  engineOsP50: number;
  clientP50: number;
  gapP50: number;
  gapP90: number;
  gapP99: number;
  stages: Record<string, number> | null;
  cpuPerOp: CpuPerOp | null;
};

/**
 * CPU time (user + system) per op of the server's process (API and agent), its engine and Redis,
 * over the measured ops: what each op costs the machine, which a busy or noisy machine moves far
 * less than it moves latency. null where /proc cannot tell (not Linux, or Redis elsewhere).
 */
type CpuPerOp = { server: number; engine: number | null; redis: number | null };
type Pids = { server: number; redis: number | null };

/** The server's engine: its child process running the engine module. */
function enginePid(server: number): number | null {
  return children(server).find((c) => cmdline(c).includes('tinker_engine')) ?? null;
}
function cpuSnapshot(p: Pids): { server: number | null; engine: number | null; redis: number | null; enginePid: number | null } {
  const e = enginePid(p.server);
  return { server: cpuMs(p.server), engine: e === null ? null : cpuMs(e), redis: p.redis === null ? null : cpuMs(p.redis), enginePid: e };
}

async function run(base: string, redis: Redis, prefix: string, clients: number, n: number, pids: Pids | null): Promise<Figures> {
  const session = (await post(base, '/create_session', { tags: [], user_metadata: {}, sdk_version: '0.38.0', type: 'create_session' })).session_id;
  const models: string[] = [];
  for (let i = 0; i < clients; i++) models.push(await createModel(base, session, i));
  // Warm-up: one op pair per model (first calls compile paths in the engine and the API).
  await Promise.all(models.map((m) => client(base, m, 1, 2)));
  const before = pids && cpuSnapshot(pids);
  const per = await Promise.all(models.map((m) => client(base, m, 3, n)));
  const after = pids && cpuSnapshot(pids);
  const ops = per.flat();
  const perOp = (a: number | null | undefined, b: number | null | undefined) => (a == null || b == null ? null : (b - a) / ops.length);
  const cpu = before && after && before.server !== null && after.server !== null
    ? { server: perOp(before.server, after.server)!, engine: before.enginePid === after.enginePid ? perOp(before.engine, after.engine) : null, redis: perOp(before.redis, after.redis) }
    : null;
  await engineTimes(redis, prefix, ops);
  const oh = overheads(ops);
  // The engine's idle time between one op and the next (with many clients: the broker's share of each hand-over).
  const byStart = [...ops].sort((a, b) => a.engine![0] - b.engine![0]);
  const gaps = byStart.slice(1).map((o, i) => o.engine![0] - byStart[i]!.engine![1]);
  return {
    clients,
    ops: ops.length,
    p50: pct(oh, 0.5),
    p99: pct(oh, 0.99),
    engineP50: pct(ops.map((o) => o.engine![1] - o.engine![0]), 0.5),
    engineFbP50: pct(ops.filter((o) => o.kind === 'fb').map((o) => o.engine![1] - o.engine![0]), 0.5),
    engineOsP50: pct(ops.filter((o) => o.kind === 'os').map((o) => o.engine![1] - o.engine![0]), 0.5),
    clientP50: pct(ops.map((o) => o.end - o.start), 0.5),
    gapP50: pct(gaps, 0.5),
    gapP90: pct(gaps, 0.9),
    gapP99: pct(gaps, 0.99),
    stages: stages(ops),
    cpuPerOp: cpu,
  };
}

async function main(): Promise<void> {
  const server = new E2EServer({ TB_LONG_POLL_MS: '25000' });
  const redis = new Redis(REDIS_URL);
  try {
    await server.start();
    // Redis's own process, when it runs on this machine (the bench's default, loopback).
    const redisPid = Number(/process_id:(\d+)/.exec(await redis.info('server'))?.[1]);
    const pids = server.pid ? { server: server.pid, redis: redisPid && cpuMs(redisPid) !== null ? redisPid : null } : null;
    const one = await run(server.baseUrl, redis, server.prefix, 1, ops1, pids);
    // The same hops without the broker, its engine busy as long as this run's ops were (bench/floor.ts).
    const fl = await floorOverheads(ops1, one.engineFbP50, one.engineOsP50);
    const floor = { p50: pct(fl, 0.5), p99: pct(fl, 0.99), engineMs: [one.engineFbP50, one.engineOsP50] };
    const many = await run(server.baseUrl, redis, server.prefix, 64, ops64, pids);
    const sdk = server.runPython([fileURLToPath(new URL('./sdk_optim_step.py', import.meta.url)), TINY_MODEL_ALIAS, String(sdkSteps)]);
    const sdkFl = await sdkFloor(server.baseUrl, { ...process.env, TINKER_API_KEY: E2E_KEY, HF_HUB_OFFLINE: '1' }, TINY_MODEL_ALIAS, sdkSteps);
    const load = (await import('node:os')).loadavg()[0]!;
    const out = { one, floor, many, sdk, sdkFloor: sdkFl, load };
    if (json) {
      console.log(JSON.stringify(out));
      return;
    }
    const f = (x: number) => x.toFixed(2);
    for (const r of [one, many]) {
      console.log(
        `${r.clients} client(s), ${r.ops} ops: broker overhead p50 ${f(r.p50)} ms, p99 ${f(r.p99)} ms (client-observed p50 ${f(r.clientP50)} ms, engine p50 ${f(r.engineP50)} ms)`,
      );
      if (r.stages) console.log(`  stages p50 (ms): ${Object.entries(r.stages).map(([k, v]) => `${k} ${f(v)}`).join(', ')}`);
      if (r.clients > 1) console.log(`  engine idle between consecutive ops (ms): p50 ${f(r.gapP50)}, p90 ${f(r.gapP90)}, p99 ${f(r.gapP99)}`);
      const c = r.cpuPerOp;
      if (c) console.log(`  CPU per op (ms, user + system): API and agent ${f(c.server)}, engine ${c.engine === null ? '-' : f(c.engine)}, Redis ${c.redis === null ? '-' : f(c.redis)}`);
      if (r === one)
        console.log(
          `  floor (the same hops without the broker, bench/floor.ts, engine ${f(floor.engineMs[0]!)} / ${f(floor.engineMs[1]!)} ms): overhead p50 ${f(floor.p50)} ms, p99 ${f(floor.p99)} ms; the broker adds ${f(one.p50 - floor.p50)} ms at p50`,
        );
    }
    console.log(
      `SDK optim_step p50 ${f(sdk.sdk_p50_ms)} ms; two plain round trips p50: ${f(sdk.plain_healthz_p50_ms)} ms (healthz), ${f(sdk.plain_404_p50_ms)} ms (404); ratio ${f(sdk.ratio_healthz)}x / ${f(sdk.ratio_404)}x`,
    );
    console.log(
      `  SDK floor (bench/sdk-floor.ts, a bare server answering optim_step and its future at once): p50 ${f(sdkFl.sdk_p50_ms)} ms; two bare 404s ${f(sdkFl.plain_404_p50_ms)} ms; ratio ${f(sdkFl.ratio_404)}x; the broker adds ${f(sdk.sdk_p50_ms - sdkFl.sdk_p50_ms)} ms`,
    );
    console.log(`load average (1 min) at the end: ${load.toFixed(1)}`);
  } finally {
    redis.disconnect();
    await server.destroy();
  }
}

runBench(main);

