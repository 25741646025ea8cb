import { randomUUID } from 'node:crypto';
import { Job, Queue } from 'bullmq';
import type { Redis } from 'ioredis';
import { expectHandOver, handOverDone } from './completions.js';
import type { Logger } from '../infra/logger.js';
import type { Names } from '../contract/names.js';
import { Outcome, type CompletedEnd, type Outcomes } from './outcomes.js';
import { scripts, TAKE_CLAIM, type OptionalArgs } from './scripts.js';
import type { TrainJob } from '../contract/schemas.js';

/** A training job as its agent takes it: the payload is unparsed (it crossed Redis; the agent parses it) unless `parsed`. */
export type TakenTrainJob = {
  id: string;
  /** The op (the BullMQ job's name). */
  op: string;
  data: unknown;
  /** When the API stored it, ms since the epoch. */
  timestamp: number;
  /**
   * The outcome's claim made as the job was taken (queues/runtime/lua/train-take.lua), when the consumer was
   * told the op would start at once: `{ prev: null }` claimed with `token`, `{ prev }` another record
   * was there first (do not run). null: not claimed yet (the agent claims it when its turn comes).
   */
  claim: { prev: Outcome | null } | null;
  /** The claim token of this job for this consumer (`<tokenPrefix><job id>`). */
  token: string;
  /** `data` is the TrainJob the gate in this process parsed before admitting it (a submit's own op, handed over): not parsed again. */
  parsed?: true;
  /** For the op's done record (Outcomes.finish): the job then ends in the same script, not in BullMQ's after it. */
  end: CompletedEnd;
};

/**
 * What a gate in this process needs to take a job for the consumer (TrainConsumer.handOff): the
 * take's arguments for queues/runtime/lua/gate-submit.lua, and `settle`, which the gate calls exactly once with
 * the script's take (or null: nothing taken, or the script failed).
 */
export type HandOff = {
  take: OptionalArgs<typeof scripts.gateSubmit>;
  /** `submitted`: the op the submit queued, its job as the gate parsed it, and the tenant its future was issued to. */
  settle: (taken: HandedJob | null, submitted: { id: string; data: TrainJob | undefined; at: number; tenant?: string | undefined }, failed: boolean) => void;
};

/** The take a submit made (queues/runtime/lua/gate-submit.lua's answer after its admit code). */
export type HandedJob = [id: string, more: number, claim: number, prev: string | null, fields: (string | null)[]];

const adopted = scripts.trainAdopt.codes;
const finished = scripts.outcomeFinish.codes;

/** The consumers of this process, by their queue's key prefix: a gate here hands them jobs (handOff). */
const local = new Map<string, TrainConsumer>();

/** The consumer of the training queue with this key prefix (`<prefix>-bull:<queue>:`) in this process, if any. */
export function localTrainConsumer(queuePrefix: string): TrainConsumer | undefined {
  return local.get(queuePrefix);
}

/** How a processed job ends: done, failed with a reason (stored as BullMQ's failedReason), or back on the queue unstarted. */
export type TrainVerdict = { state: 'done' } | { state: 'failed'; reason: string } | { state: 'requeue' };

export type TrainConsumerOptions = {
  /** Jobs held at once: the one running and those taken ahead of it (a job whose processing returned, ending in its queue, is not counted). */
  concurrency: number;
  /** The job lock's duration; it is renewed every half of it while the job is held. */
  lockMs: number;
  /** Whose claim a take makes (the outcome's `agent_id`) and its token's text before the job id. */
  agentId: string;
  tokenPrefix: string;
  /** Whether the next job taken would start at once (its outcome is then claimed in the same script). */
  claimAtTake: () => boolean;
  /** Whether a gate in this process may take jobs for it (handOff). @defaultValue true */
  handOff?: boolean;
  /**
   * Ops that a submit in this process hands over start once that submit has answered its client
   * (after this turn of the event loop: the gate hands the job over before its caller writes the
   * answer): the client has its answer, and sends its next request, sooner, by all the work of
   * receiving and starting the op; the op starts as much later. Worth it for a short op, which ends
   * before the client asks for its result anyway (workers/agent/training.ts: optim_step).
   */
  startsAfterAnswer?: (op: string) => boolean;
  process: (job: TakenTrainJob) => Promise<TrainVerdict>;
  log: Logger;
};

/**
 * The consumer of one agent's training queue (`train-<agentId>`), in place of a BullMQ Worker: its
 * jobs are BullMQ jobs on a BullMQ queue (the gate and the API write them as BullMQ does; BullMQ's
 * Queue, Job and the inspect tools read them), taken by one script that also claims the op's outcome
 * (queues/runtime/lua/train-take.lua), and ended, when its op is recorded done, by the script that records
 * it (Outcomes.finish with `TakenTrainJob.end`: queues/runtime/lua/bullmq-job.lua bullCompleteJob does what
 * BullMQ's moveToFinished does for these jobs), else by BullMQ's own moveToFinished
 * (Job.moveToCompleted / moveToFailed). A training queue has one consumer, its agent, so the take
 * leaves no marker behind (a BullMQ Worker pays an empty moveToActive per job for it, two with a job
 * held ahead): per job one blocking wait on the marker, one take and one record that ends the job,
 * against a Worker's BZPOPMIN, three moveToActive, the outcome's separate claim and record, and
 * moveToFinished.
 *
 * When an API in the consumer's process submits the op its queue runs next, the submit's script takes
 * the job for it and the gate hands it over in memory (handOff): no wake on the marker, no take of its
 * own, and the payload does not come back from Redis. The take is the same Redis-side step
 * (queues/runtime/lua/train-take-lib.lua) and one take is in flight at a time (a hand-off's or the
 * consumer's), so jobs run in the queue's order.
 *
 * Like the Worker it replaces (`maxStalledCount: 0`, `skipStalledCheck`): no stalled check runs, a
 * job is never retried, a lock lost in a long Redis outage leaves the job active (its outcome record,
 * not BullMQ's state, is the op's truth, queues/runtime/outcomes.ts), and the reaper fails the ops of a dead
 * agent from its queue's lists (queues/runtime/liveness.ts). A dead agent that comes back under its id
 * before the reaper acts settles its predecessor's active jobs itself at start (adoptEarlier).
 */
export class TrainConsumer {
  private readonly queue: Queue;
  private readonly blocking: Redis;
  private readonly held = new Map<string, { job: () => Job }>();
  private readonly lockToken = randomUUID();
  private closing = false;
  private loopDone: Promise<void> = Promise.resolve();
  private slotFreed: (() => void) | null = null;
  /** Jobs taken whose processing has not returned (one going back to its queue counts until it is back). */
  private processing = 0;
  /** A take of this consumer's (its own, or a hand-off's) is in flight. */
  private taking = false;
  private handing: Promise<void> | null = null;
  /** A take failed without an answer: it may have left a job active under this consumer's lock (recover). */
  private orphans = false;
  /** Jobs processed here whose BullMQ end failed: active under this lock, and never to be run again. */
  private readonly unended = new Set<string>();
  private drained: (() => void) | null = null;
  private lockTimer: NodeJS.Timeout | undefined;
  private readonly keys: { wait: string; active: string; events: string; marker: string; prefix: string };

  constructor(
    private readonly redis: Redis,
    private readonly names: Names,
    private readonly outcomes: Outcomes,
    readonly name: string,
    private readonly o: TrainConsumerOptions,
  ) {
    this.queue = new Queue(name, { connection: redis, prefix: names.bull });
    this.queue.on('error', () => undefined);
    // BZPOPMIN blocks its connection: a connection of its own, as a Worker has.
    this.blocking = redis.duplicate({ connectionName: undefined });
    this.blocking.on('error', () => undefined);
    const prefix = `${names.bull}:${name}:`;
    this.keys = { wait: `${prefix}wait`, active: `${prefix}active`, events: `${prefix}events`, marker: `${prefix}marker`, prefix };
  }

  /** Starts taking jobs. */
  async start(): Promise<void> {
    await this.queue.waitUntilReady();
    this.lockTimer = setInterval(() => void this.extendLocks(), Math.max(100, Math.floor(this.o.lockMs / 2)));
    await this.adoptEarlier();
    if (this.o.handOff !== false) local.set(this.keys.prefix, this);
    this.loopDone = this.loop();
  }

  /** Takes no more jobs and waits for those held to end (one taken ahead goes back to its queue: the processor's 'requeue'). */
  async close(): Promise<void> {
    if (this.closing) return this.loopDone;
    this.closing = true;
    if (local.get(this.keys.prefix) === this) local.delete(this.keys.prefix);
    this.slotFreed?.();
    this.blocking.disconnect();
    await this.loopDone;
    while (this.handing) await this.handing;
    if (this.held.size) await new Promise<void>((r) => (this.drained = r));
    clearInterval(this.lockTimer);
    await this.queue.close().catch(() => undefined);
  }

  private async loop(): Promise<void> {
    let more = true; // at start, look before blocking
    let backoffMs = 0;
    while (!this.closing) {
      if (this.processing >= this.o.concurrency) {
        await new Promise<void>((r) => (this.slotFreed = r));
        this.slotFreed = null;
        continue;
      }
      try {
        if (!more) await this.blocking.bzpopmin(this.keys.marker, 5);
        // A hand-off's take went to Redis first: its job runs first.
        while (this.handing) await this.handing;
        if (this.closing) break;
        if (this.orphans) await this.recover();
        this.taking = true;
        const t = await this.take().finally(() => (this.taking = false));
        backoffMs = 0;
        more = t?.more ?? false;
        if (t?.job) this.run(t.job, t.taken);
      } catch (e) {
        if (this.closing) break;
        more = true;
        this.orphans = true;
        backoffMs = Math.min(1_000, backoffMs * 2 || 50);
        this.o.log.debug('training queue: take failed (Redis unreachable?)', { queue: this.name, error: String(e) });
        await new Promise((r) => setTimeout(r, backoffMs));
      }
    }
  }

  /** What a take sends, by this consumer's own take (train-take.lua) or a submit's (gate-submit.lua): its lock, and whether and how it claims the op's outcome. */
  private takeArgs() {
    const [outcomeBefore, outcomeAfter] = this.names.outcomeParts();
    return {
      lockToken: this.lockToken,
      lockMs: this.o.lockMs,
      claim: this.o.claimAtTake() ? '1' : '0',
      outcomeBefore,
      outcomeAfter,
      agentId: this.o.agentId,
      tokenPrefix: this.o.tokenPrefix,
      outcomeTtlS: this.outcomes.ttlS,
    };
  }

  private async take(): Promise<{ more: boolean; job: (() => Job) | null; taken: TakenTrainJob } | null> {
    const now = Date.now();
    const r = await scripts.trainTake.run(this.redis, {
      keys: { wait: this.keys.wait, active: this.keys.active, events: this.keys.events, marker: this.keys.marker },
      args: { queuePrefix: this.keys.prefix, now, nowIso: new Date(now).toISOString(), ...this.takeArgs() },
    });
    if (!r) return null;
    const [hash, id, more, claimed, prev] = r;
    const raw: Record<string, string> = {};
    for (let i = 0; i + 1 < hash.length; i += 2) raw[hash[i]!] = hash[i + 1]!;
    return this.received(id, more, claimed, prev, raw, raw.data === undefined ? undefined : JSON.parse(raw.data), now);
  }

  /**
   * The take of a submit in this process (null while a take is in flight, with jobs processing to
   * the concurrency, or closing): the arguments for queues/runtime/lua/gate-submit.lua, and `settle`, which the
   * gate must call once whatever the script did. Until then the consumer's own takes wait, so jobs
   * run in the order Redis gave them out, whichever take took them.
   */
  handOff(): HandOff | null {
    if (this.closing || this.taking || this.handing || this.orphans || this.processing >= this.o.concurrency) return null;
    let done!: () => void;
    this.handing = new Promise<void>((r) => (done = r));
    return {
      take: { take: '1', ...this.takeArgs() },
      settle: (handed, submitted, failed) => {
        if (failed) {
          // The script may have taken a job: find it before anything else is taken.
          this.orphans = true;
          void this.recover()
            .catch((e) => this.o.log.debug('training queue: recovery after a lost answer failed; retried before the next take', { queue: this.name, error: String(e) }))
            .finally(() => {
              this.handing = null;
              done();
            });
          return;
        }
        const receive = () => {
          try {
            // Run even when closing: the processor puts a job it will not start back (close waits for it).
            if (!handed) return;
            const [id, more, claimed, prev, f] = handed;
            const raw: Record<string, string> = {};
            const gone = claimed === TAKE_CLAIM.jobGone;
            if (!gone) ['name', 'opts', 'timestamp', 'ats', 'atm'].forEach((k, i) => f[i] != null && (raw[k] = f[i]!));
            const data = id === submitted.id ? submitted.data : f[5] == null ? undefined : JSON.parse(f[5]);
            const t = this.received(id, more, gone ? TAKE_CLAIM.notClaimed : claimed, prev, raw, data, submitted.at);
            if (id === submitted.id && submitted.data !== undefined) t.taken.parsed = true;
            // Its future, asked for here, waits for this agent's hand-over without reading Redis.
            if (id === submitted.id && t.job && submitted.tenant) expectHandOver(this.names.outcomesChannel(), id, submitted.tenant);
            if (t.job) this.run(t.job, t.taken);
          } finally {
            // Until now the consumer's own takes wait: jobs run in the order Redis gave them out.
            this.handing = null;
            done();
          }
        };
        const op = handed && handed[0] === submitted.id ? submitted.data?.op : undefined;
        if (op && this.o.startsAfterAnswer?.(op)) setImmediate(receive);
        else receive();
      },
    };
  }

  /**
   * At start: the jobs an earlier process of this agent id left active (it died: kill -9, OOM, a lost
   * node; this process holds the id now, queues/runtime/liveness.ts claimId). No take hands them out again,
   * so each is settled here (queues/runtime/lua/train-adopt.lua): an op that never started (no outcome
   * record) goes back to the head of the queue and runs in its place; one with a record is held
   * under this consumer's lock and processed with that record as its claim's `prev`, so the
   * processor ends it as the record says (a running record: the earlier process's op, whose outcome
   * nobody knows). Returns how many were requeued and held.
   */
  private async adoptEarlier(): Promise<{ requeued: number; held: number }> {
    // The active list's head is its newest job: requeued newest first, the oldest ends up taken first.
    const ids = await this.redis.lrange(this.keys.active, 0, -1);
    const held: { id: string; record: string }[] = [];
    let requeued = 0;
    for (const id of ids) {
      if (this.held.has(id)) continue;
      const jobKey = `${this.keys.prefix}${id}`;
      const r = await scripts.trainAdopt.run(this.redis, {
        keys: { active: this.keys.active, wait: this.keys.wait, marker: this.keys.marker, events: this.keys.events, job: jobKey, lock: `${jobKey}:lock`, outcome: this.names.outcome(id) },
        args: { jobId: id, lockToken: this.lockToken, lockMs: this.o.lockMs },
      });
      if (r[0] === adopted.requeued) requeued++;
      if (r[0] === adopted.held) held.push({ id, record: r[1]! });
    }
    // Oldest first.
    for (const { id, record } of held.reverse()) {
      const raw = await this.redis.hgetall(`${this.keys.prefix}${id}`);
      const t = this.received(id, 0, TAKE_CLAIM.recordFirst, record, raw, raw.data === undefined ? undefined : JSON.parse(raw.data), Number(raw.processedOn ?? Date.now()));
      if (t.job) this.run(t.job, t.taken);
    }
    if (requeued || held.length) this.o.log.warn('training queue: ops left by an earlier process of this agent are settled', { queue: this.name, requeued, held: held.length });
    return { requeued, held: held.length };
  }

  /**
   * After a take whose answer was lost (the consumer's own, or a submit's for it): a take that ran in
   * Redis left its job active under this consumer's lock, and nothing here holds it. Runs such jobs
   * first, oldest first, with their claim as the take left it; then takes may go on.
   */
  private async recover(): Promise<void> {
    // A take puts its job at the head of the active list: the oldest is last.
    const ids = (await this.redis.lrange(this.keys.active, 0, -1)).reverse();
    for (const id of ids) {
      if (this.held.has(id) || this.unended.has(id)) continue;
      const [lock, outcome] = await Promise.all([this.redis.get(`${this.keys.prefix}${id}:lock`), this.redis.get(this.names.outcome(id))]);
      if (lock !== this.lockToken) continue;
      const raw = await this.redis.hgetall(`${this.keys.prefix}${id}`);
      // Claimed by the take (this consumer's token on a running record), by no one, or another record stands.
      const rec = outcome === null ? null : Outcome.parse(JSON.parse(outcome));
      const claimed =
        rec === null ? TAKE_CLAIM.notClaimed : rec.state === 'running' && rec.token === `${this.o.tokenPrefix}${id}` ? TAKE_CLAIM.claimed : TAKE_CLAIM.recordFirst;
      this.o.log.warn('training queue: a job taken without its answer reaching this agent runs now', { queue: this.name, jobId: id });
      const t = this.received(id, 0, claimed, outcome, raw, raw.data === undefined ? undefined : JSON.parse(raw.data), Number(raw.processedOn ?? Date.now()));
      if (t.job) this.run(t.job, t.taken);
    }
    this.orphans = false;
  }

  /** A job as a take returned it (`raw`: the job hash's fields; `data`: its payload, parsed). */
  private received(id: string, more: number, claimed: number, prev: string | null, raw: Record<string, string>, data: unknown, takenAt: number): { more: boolean; job: (() => Job) | null; taken: TakenTrainJob } {
    const taken: TakenTrainJob = {
      id,
      op: raw.name ?? '',
      data,
      timestamp: Number(raw.timestamp ?? takenAt),
      claim: claimed === TAKE_CLAIM.notClaimed ? null : { prev: claimed === TAKE_CLAIM.recordFirst && prev ? Outcome.parse(JSON.parse(prev)) : null },
      token: `${this.o.tokenPrefix}${id}`,
      end: { queuePrefix: this.keys.prefix, lockToken: this.lockToken },
    };
    if (raw.name === undefined) {
      this.o.log.warn('training queue: a queued job had no stored job; skipped', { queue: this.name, jobId: id });
      return { more: more === 1, job: null, taken };
    }
    // The BullMQ Job that ends it, built once the op has run (off the path to the engine).
    const name = raw.name;
    const job = () => {
      const j = new Job(this.queue, name, taken.data, Job.optsFromJSON(raw.opts), id);
      j.timestamp = taken.timestamp;
      j.processedOn = takenAt;
      j.attemptsStarted = Number(raw.ats ?? 1);
      j.attemptsMade = Number(raw.atm ?? 0);
      return j;
    };
    return { more: more === 1, job, taken };
  }

  /** Processes one job and ends it as the processor says; never throws. */
  private run(makeJob: () => Job, taken: TakenTrainJob): void {
    this.held.set(taken.id, { job: makeJob });
    this.processing++;
    let counted = true;
    const uncount = () => {
      if (!counted) return;
      counted = false;
      this.processing--;
      this.slotFreed?.();
    };
    void (async () => {
      let verdict: TrainVerdict;
      try {
        verdict = await this.o.process(taken);
      } catch (e) {
        verdict = { state: 'failed', reason: e instanceof Error ? e.message : String(e) };
      }
      // Ran: the next job may be taken while this one ends in its queue. One going back waits until
      // it is back at the head, so the queue's order holds.
      if (verdict.state !== 'requeue') uncount();
      try {
        // Ended already by the script that recorded its outcome (Outcomes.finish with taken.end).
        const ended = verdict.state === 'done' ? taken.end.ended : undefined;
        if (ended === finished.ended) return;
        if (ended !== undefined && ended !== finished.leftForBullmq) throw new Error(`the job was not active under this consumer's lock (code ${ended})`);
        const job = makeJob();
        if (verdict.state === 'done') await job.moveToCompleted(null, this.lockToken, false);
        else if (verdict.state === 'failed') await job.moveToFailed(Object.assign(new Error(verdict.reason), { name: 'UnrecoverableError' }), this.lockToken, false);
        else await job.moveToWait(this.lockToken);
      } catch (e) {
        // A lock lost in a long Redis outage: the job stays active; its outcome record is the truth.
        this.o.log.warn('training job not ended in its queue', { queue: this.name, jobId: taken.id, op: taken.op, verdict: verdict.state, error: String(e) });
        if (verdict.state !== 'requeue') this.unended.add(taken.id);
      } finally {
        this.held.delete(taken.id);
        handOverDone(this.names.outcomesChannel(), taken.id);
        uncount();
        if (this.closing && this.held.size === 0) this.drained?.();
      }
    })();
  }

  private async extendLocks(): Promise<void> {
    for (const [id, h] of this.held) {
      await h.job().extendLock(this.lockToken, this.o.lockMs).catch((e) => this.o.log.debug('training job lock not extended', { queue: this.name, jobId: id, error: String(e) }));
    }
  }
}
