import type { ChainableCommander, Redis } from 'ioredis';
import { z } from 'zod';
import type { Names } from '../contract/names.js';

/**
 * Operation metrics kept in Redis, so that every API process's `/metrics` reports the whole
 * deployment whichever agent ran the work. Agents record each finished job; the API reads.
 *
 * - `<prefix>:metrics:jobs` hash, `<op>|<status>` → count (status `ok`, `user_error`, `server_error`);
 * - `<prefix>:metrics:latency:<phase>` hash per phase (`queue_wait`: enqueued → taken by an agent,
 *   BullMQ `processedOn − timestamp`; `engine`: taken → finished; `total`: enqueued → finished):
 *   `<op>|<bucket index>` → count, `<op>|sum` (ms), `<op>|count`;
 * - `<prefix>:metrics:tokens` hash, `sampled` / `trained` → totals, and
 *   `<prefix>:metrics:tokens:<kind>:<unix second>` counters that expire, for the recent rate;
 * - `<prefix>:metrics:agents` hash, agent id → AgentStats (engine memory), refreshed with the heartbeat.
 */

/** Upper bounds of the latency buckets, in seconds. */
export const LATENCY_BUCKETS_S = [0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600] as const;
export const PHASES = ['queue_wait', 'engine', 'total'] as const;
export type Phase = (typeof PHASES)[number];
export type JobStatus = 'ok' | 'user_error' | 'server_error';
export type TokenKind = 'sampled' | 'trained';

/** Seconds over which the recent token rates are averaged. */
export const RATE_WINDOW_S = 60;

export const AgentStats = z.object({
  agent_id: z.string(),
  engine: z.string(),
  device: z.string(),
  /** Resident memory of the engine process tree, in bytes. */
  engine_rss_bytes: z.number().nullable(),
  /** GPU memory the engine's processes hold (nvidia-smi), in bytes; null without a GPU. */
  gpu_memory_bytes: z.number().nullable(),
  /** GPU turns (workers/gpu-turns.ts) of an agent that takes them: turns taken and handed over, ms in its engine's wake-ups and hand-overs, waiting for and holding the turn. */
  gpu_turns: z
    .object({ taken: z.number(), given: z.number(), acquire_ms: z.number(), release_ms: z.number(), wait_ms: z.number(), held_ms: z.number(), holding: z.boolean() })
    .optional(),
  updated_at: z.string(),
});
export type AgentStats = z.infer<typeof AgentStats>;

const key = (names: Names, ...parts: string[]) => names.metrics(...parts);

function bucketIndex(ms: number): number {
  const s = ms / 1000;
  const i = LATENCY_BUCKETS_S.findIndex((b) => s <= b);
  return i === -1 ? LATENCY_BUCKETS_S.length : i; // the last index is +Inf
}

/** One finished job, with its BullMQ timestamps (ms since the epoch), and the tokens it sampled or trained. */
export type JobTiming = { op: string; status: JobStatus; enqueuedAt: number; startedAt: number; finishedAt: number; tokens?: { kind: TokenKind; n: number } };

/** Records one finished job (and its tokens) in one transaction: one round trip. */
export async function recordJob(redis: Redis, names: Names, t: JobTiming): Promise<void> {
  const m = redis.multi();
  addJobs(m, names, [t]);
  await m.exec();
}

/**
 * Finished jobs recorded together: the jobs of `windowMs` in one transaction, their counts and sums
 * added up first (one round trip and one command per counter for a burst of jobs instead of ten
 * commands each; /metrics sees a job at most `windowMs` late). `flush` writes what is pending at
 * once (an agent stopping).
 */
export class JobRecorder {
  private pending: JobTiming[] = [];
  private timer: NodeJS.Timeout | undefined;

  constructor(
    private readonly redis: Redis,
    private readonly names: Names,
    private readonly onError: (e: unknown) => void,
    private readonly windowMs = 100,
  ) {}

  add(t: JobTiming): void {
    this.pending.push(t);
    this.timer ??= setTimeout(() => void this.flush(), this.windowMs);
  }

  async flush(): Promise<void> {
    clearTimeout(this.timer);
    this.timer = undefined;
    const jobs = this.pending;
    if (!jobs.length) return;
    this.pending = [];
    const m = this.redis.multi();
    addJobs(m, this.names, jobs);
    await m.exec().catch(this.onError);
  }
}

/**
 * Adds the commands that record finished jobs (and their tokens) to a transaction: each counter once,
 * by the jobs' total (a hash field's count or sum, a second's tokens).
 */
export function addJobs(m: ChainableCommander, names: Names, jobs: readonly JobTiming[]): void {
  const counts = new Sums();
  const sums = new Sums();
  const seconds = new Map<string, number>();
  for (const t of jobs) {
    const phases: Record<Phase, number> = {
      queue_wait: Math.max(0, t.startedAt - t.enqueuedAt),
      engine: Math.max(0, t.finishedAt - t.startedAt),
      total: Math.max(0, t.finishedAt - t.enqueuedAt),
    };
    counts.add(key(names, 'jobs'), `${t.op}|${t.status}`, 1);
    for (const phase of PHASES) {
      const h = key(names, 'latency', phase);
      counts.add(h, `${t.op}|${bucketIndex(phases[phase])}`, 1);
      counts.add(h, `${t.op}|count`, 1);
      sums.add(h, `${t.op}|sum`, phases[phase]);
    }
    if (t.tokens && t.tokens.n > 0) {
      counts.add(key(names, 'tokens'), t.tokens.kind, t.tokens.n);
      const sec = tokenSecond(names, t.tokens.kind, t.finishedAt);
      seconds.set(sec, (seconds.get(sec) ?? 0) + t.tokens.n);
    }
  }
  counts.each((h, f, n) => m.hincrby(h, f, n));
  sums.each((h, f, n) => m.hincrbyfloat(h, f, n));
  for (const [sec, n] of seconds) m.incrby(sec, n).expire(sec, RATE_WINDOW_S * 3);
}

/** Totals per (hash, field). */
class Sums {
  private readonly byHash = new Map<string, Map<string, number>>();
  add(hash: string, field: string, n: number): void {
    let h = this.byHash.get(hash);
    if (!h) this.byHash.set(hash, (h = new Map()));
    h.set(field, (h.get(field) ?? 0) + n);
  }
  each(fn: (hash: string, field: string, n: number) => void): void {
    for (const [hash, h] of this.byHash) for (const [field, n] of h) fn(hash, field, n);
  }
}

/** The counter of the tokens of `kind` in the second of `at` (ms), which expires (the recent rate). */
const tokenSecond = (names: Names, kind: TokenKind, at: number) => key(names, 'tokens', kind, String(Math.floor(at / 1000)));

function addTokens(m: ChainableCommander, names: Names, kind: TokenKind, n: number, now: number): void {
  if (!(n > 0)) return;
  const sec = tokenSecond(names, kind, now);
  m.hincrby(key(names, 'tokens'), kind, n).incrby(sec, n).expire(sec, RATE_WINDOW_S * 3);
}

export async function recordTokens(redis: Redis, names: Names, kind: TokenKind, n: number, now = Date.now()): Promise<void> {
  if (!(n > 0)) return;
  const m = redis.multi();
  addTokens(m, names, kind, n, now);
  await m.exec();
}

export async function publishAgentStats(redis: Redis, names: Names, s: AgentStats): Promise<void> {
  await redis.hset(key(names, 'agents'), s.agent_id, JSON.stringify(s));
}
export async function removeAgentStats(redis: Redis, names: Names, agentId: string): Promise<void> {
  await redis.hdel(key(names, 'agents'), agentId);
}
export async function readAgentStats(redis: Redis, names: Names): Promise<Map<string, AgentStats>> {
  const all = await redis.hgetall(key(names, 'agents'));
  return new Map(Object.entries(all).map(([id, v]) => [id, AgentStats.parse(JSON.parse(v))]));
}

export type Histogram = { buckets: number[]; sumMs: number; count: number };

/** Everything recorded: job counts, latency histograms by phase and op (cumulative buckets), token totals and recent rates. */
export async function readMetrics(
  redis: Redis,
  names: Names,
  now = Date.now(),
): Promise<{
  jobs: { op: string; status: string; count: number }[];
  latency: Record<Phase, Map<string, Histogram>>;
  tokens: Record<TokenKind, { total: number; perSecond: number }>;
}> {
  const jobsRaw = await redis.hgetall(key(names, 'jobs'));
  const jobs = Object.entries(jobsRaw).map(([f, v]) => {
    const [op, status] = f.split('|') as [string, string];
    return { op, status, count: Number(v) };
  });
  const latency = {} as Record<Phase, Map<string, Histogram>>;
  for (const phase of PHASES) {
    const raw = await redis.hgetall(key(names, 'latency', phase));
    const byOp = new Map<string, Histogram>();
    const get = (op: string) => {
      let h = byOp.get(op);
      if (!h) byOp.set(op, (h = { buckets: new Array(LATENCY_BUCKETS_S.length + 1).fill(0), sumMs: 0, count: 0 }));
      return h;
    };
    for (const [f, v] of Object.entries(raw)) {
      const [op, what] = f.split('|') as [string, string];
      const h = get(op);
      if (what === 'sum') h.sumMs = Number(v);
      else if (what === 'count') h.count = Number(v);
      else h.buckets[Number(what)] = Number(v);
    }
    for (const h of byOp.values()) for (let i = 1; i < h.buckets.length; i++) h.buckets[i]! += h.buckets[i - 1]!;
    latency[phase] = byOp;
  }
  const totals = await redis.hgetall(key(names, 'tokens'));
  // The last full seconds, not the current one (still being counted).
  const nowS = Math.floor(now / 1000);
  const tokens = {} as Record<TokenKind, { total: number; perSecond: number }>;
  for (const kind of ['sampled', 'trained'] as const) {
    const secs = Array.from({ length: RATE_WINDOW_S }, (_, i) => key(names, 'tokens', kind, String(nowS - 1 - i)));
    const vals = await redis.mget(secs);
    const inWindow = vals.reduce((s, v) => s + Number(v ?? 0), 0);
    tokens[kind] = { total: Number(totals[kind] ?? 0), perSecond: inWindow / RATE_WINDOW_S };
  }
  return { jobs, latency, tokens };
}
