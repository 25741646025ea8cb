import type { Worker } from 'bullmq';
import type { Redis } from 'ioredis';
import type { Logger } from '../../queues/infra/logger.js';

/**
 * Least-loaded sharing of one sample queue between the agents that serve it.
 *
 * Every agent serving a base model takes jobs from the same BullMQ queue. Left alone, the first idle
 * agent to fetch takes up to its whole concurrency of a burst, one job after another, before the
 * others wake: a burst of 32 split 32/0 between two idle agents. So each agent publishes how many of
 * the queue's jobs it holds (a field of `Names.sampleShare(queue)`), and caps its worker's
 * concurrency at its fair share of the work: the jobs all live agents hold plus those waiting,
 * weighted by each agent's configured concurrency, plus `slack` (`shareCap`). The cap is recomputed
 * as this agent's jobs start and end, every `beatMs`, and every `pollMs` while the agent is at its
 * cap (so a job never waits on the cap once another agent finishes, stops or dies: a dead agent's
 * field stops counting `staleMs` after its last write). An agent alone uses its whole concurrency;
 * until a beat finds another agent, it reads and writes at the beat only.
 *
 * Ages are told by Redis's clock (TIME, read with every write), so agents on hosts whose clocks
 * differ agree on which fields are stale.
 */

/** One agent's field: the jobs it holds, its configured concurrency, and when it wrote them (Redis's clock, ms). */
export type ShareEntry = { active: number; concurrency: number; at: number };

export type ShareTimings = {
  /**
   * Jobs an agent may take beyond its exact share, so that every agent has room for the next
   * arrival while the shares catch up.
   * @defaultValue 2
   */
  slack: number;
  /**
   * How often an agent rewrites its field and reads the others' when nothing else made it.
   * @defaultValue 500
   */
  beatMs: number;
  /**
   * A field not rewritten for this long is a dead (or frozen) agent's: it no longer counts, and the
   * next reader removes it.
   * @defaultValue 2000
   */
  staleMs: number;
  /**
   * While the agent is at its cap, how often it reads the shares again.
   * @defaultValue 25
   */
  pollMs: number;
};

export const SHARE_TIMINGS: ShareTimings = { slack: 2, beatMs: 500, staleMs: 2_000, pollMs: 25 };

/** The share key's TTL, in fields' lifetimes: the key leaves with the last agent that wrote it. */
const KEY_TTL_STALES = 5;
/** How long a closing share waits for its field's removal. */
const CLOSE_WAIT_MS = 1_000;

/**
 * The concurrency an agent may use on a queue: its concurrency-weighted share of every job the live
 * agents hold plus those waiting, rounded up, plus `slack`; at least 1, at most its own concurrency.
 * Alone (no other live agent), its whole concurrency.
 */
export function shareCap(mine: { active: number; concurrency: number }, others: readonly { active: number; concurrency: number }[], waiting: number, slack: number): number {
  if (!others.length) return mine.concurrency;
  const total = mine.active + waiting + others.reduce((n, o) => n + o.active, 0);
  const concurrency = mine.concurrency + others.reduce((n, o) => n + o.concurrency, 0);
  const fair = Math.ceil((total * mine.concurrency) / concurrency) + slack;
  return Math.max(1, Math.min(mine.concurrency, fair));
}

/** Parses a field; null for one this version cannot read (it is then treated as stale). */
export function parseEntry(raw: string): ShareEntry | null {
  try {
    const v = JSON.parse(raw) as Partial<ShareEntry>;
    return typeof v.active === 'number' && typeof v.concurrency === 'number' && typeof v.at === 'number' ? { active: v.active, concurrency: v.concurrency, at: v.at } : null;
  } catch {
    return null;
  }
}

export type SampleShareOptions = {
  redis: Redis;
  /** `Names.sampleShare(queue)`. */
  key: string;
  agentId: string;
  /** The agent's configured concurrency on this queue (`TB_SAMPLE_CONCURRENCY`). */
  concurrency: number;
  /** The queue's worker; its concurrency is set to the cap. */
  worker: Worker;
  log: Logger;
  timings?: Partial<ShareTimings>;
};

export class SampleShare {
  /** Jobs of this queue this agent holds (their processor is running). */
  private active = 0;
  private cap: number;
  /** Redis's clock minus this host's, ms (from the TIME of the last read). */
  private offsetMs = 0;
  private readonly t: ShareTimings;
  private queued = false;
  private running: Promise<void> | null = null;
  private again = false;
  private beat: NodeJS.Timeout | undefined;
  private poll: NodeJS.Timeout | undefined;
  private closed = false;
  /**
   * The last read found no other live agent: the cap is the whole concurrency whatever this agent
   * holds, so a job's start or end needs no read, and this agent's field is rewritten at the beat
   * only (another agent reading it meanwhile sees a count up to `beatMs` old, and both caps settle at
   * the next beats). Saves a round trip per job start and end of a lone agent's burst
   * (bench/request-cost.ts).
   */
  private alone = false;

  constructor(private readonly o: SampleShareOptions) {
    this.t = { ...SHARE_TIMINGS, ...o.timings };
    this.cap = o.concurrency;
  }

  /** Reads Redis's clock, publishes this agent's field and reads the others' once, then every `beatMs`. */
  async start(): Promise<void> {
    const sent = Date.now();
    this.offsetMs = redisMs(await this.o.redis.time()) - Math.round((sent + Date.now()) / 2);
    await this.sync();
    this.beat = setInterval(() => this.schedule(), this.t.beatMs);
    this.beat.unref();
  }

  /** A job's processor started. */
  started(): void {
    this.active++;
    if (!this.alone) this.schedule();
  }

  /** A job's processor ended. */
  ended(): void {
    this.active--;
    if (!this.alone) this.schedule();
  }

  /** Jobs this agent may still take under its cap (for the gatherer's hint). */
  room(): number {
    return Math.max(0, this.cap - this.active);
  }

  /**
   * Stops reading and writing, and removes this agent's field: the others' caps grow at their next
   * read. The removal goes after any write in flight (one connection keeps the order). It is waited
   * for at most `CLOSE_WAIT_MS`: with Redis unreachable the field is left to go stale.
   */
  async close(): Promise<void> {
    this.closed = true;
    clearInterval(this.beat);
    clearTimeout(this.poll);
    const removed = this.o.redis.hdel(this.o.key, this.o.agentId).catch((e) => this.o.log.debug('sample share not removed', { key: this.o.key, error: String(e) }));
    let timer: NodeJS.Timeout | undefined;
    await Promise.race([removed, new Promise((r) => (timer = setTimeout(r, CLOSE_WAIT_MS)))]);
    clearTimeout(timer);
  }

  /** One read-and-write soon (those asked for in one turn of the event loop go as one). */
  private schedule(): void {
    if (this.queued || this.closed) return;
    this.queued = true;
    setImmediate(() => {
      this.queued = false;
      void this.sync();
    });
  }

  /** Writes this agent's field, reads every field and the queue's waiting jobs, and applies the cap; one at a time. */
  private sync(): Promise<void> {
    if (this.running) {
      this.again = true;
      return this.running;
    }
    const run = (this.running = this.exchange()
      .catch((e: unknown) => {
        this.o.log.debug('sample share not read', { key: this.o.key, error: String(e) });
      })
      .finally(() => {
        this.running = null;
        if (this.again) {
          this.again = false;
          this.schedule();
        }
      }));
    return run;
  }

  private async exchange(): Promise<void> {
    if (this.closed) return;
    const { redis, key, agentId, concurrency, worker } = this.o;
    const sent = Date.now();
    const mine: ShareEntry = { active: this.active, concurrency, at: sent + this.offsetMs };
    const replies = await redis
      .multi()
      .hset(key, agentId, JSON.stringify(mine))
      .pexpire(key, this.t.staleMs * KEY_TTL_STALES)
      .time()
      .hgetall(key)
      .llen(worker.keys.wait!)
      .exec();
    if (!replies) return;
    for (const [err] of replies) if (err) throw err;
    const now = redisMs(replies[2]![1] as [string, string]);
    this.offsetMs = now - Math.round((sent + Date.now()) / 2);
    const fields = replies[3]![1] as Record<string, string>;
    const waiting = replies[4]![1] as number;
    const others: ShareEntry[] = [];
    const stale: string[] = [];
    for (const [id, raw] of Object.entries(fields)) {
      if (id === agentId) continue;
      const e = parseEntry(raw);
      if (e && now - e.at <= this.t.staleMs) others.push(e);
      else stale.push(id);
    }
    if (stale.length) void redis.hdel(key, ...stale).catch(() => undefined);
    if (this.closed) return;
    this.alone = others.length === 0;
    this.apply(shareCap({ active: this.active, concurrency }, others, waiting, this.t.slack));
  }

  /** Sets the worker's concurrency to `cap`; while the agent is at a cap below its concurrency, reads again in `pollMs`. */
  private apply(cap: number): void {
    const { worker } = this.o;
    const raised = cap > worker.concurrency;
    this.cap = cap;
    if (cap !== worker.concurrency) worker.concurrency = cap;
    if (raised) wake(worker);
    clearTimeout(this.poll);
    if (this.active >= cap && cap < this.o.concurrency) {
      this.poll = setTimeout(() => this.schedule(), this.t.pollMs);
      this.poll.unref();
    }
  }
}

/** Redis's TIME answer (seconds, microseconds) in ms. */
function redisMs([sec, usec]: readonly (string | number)[]): number {
  return Number(sec) * 1000 + Math.floor(Number(usec) / 1000);
}

/**
 * Makes a worker's main loop look at its concurrency now. BullMQ reads `concurrency` before each
 * fetch, but while every slot is taken its loop waits for a job to end, so a raised concurrency would
 * wait for the next end. `Worker.resume()` wakes the loop the same way: a settled promise added to
 * the loop's queue (bullmq 6.7 `classes/worker.js`). test/sample-share.test.ts checks that a worker
 * at its cap takes a waiting job as soon as the cap is raised.
 */
export function wake(worker: Worker): void {
  (worker as unknown as { mainLoopQueue?: { add(p: Promise<unknown>): void } | null }).mainLoopQueue?.add(Promise.resolve());
}
