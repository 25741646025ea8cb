import type { Redis } from 'ioredis';
import type { Failure } from '../contract/errors.js';
import type { FutureRef } from '../contract/futures.js';
import type { Names } from '../contract/names.js';
import type { Outcome } from './outcomes.js';
import { sessionSignalKeyOfJob } from './session-futures.js';

/**
 * Completion signals, so a waiting `retrieve_future` answers the moment its op finishes, never by
 * polling. Both come on one channel per deployment (`Names.outcomesChannel`), to which each API
 * process holds one subscriber connection, as `<job id>` or `<job id> <final record>`:
 * - a training op's outcome becoming final is published by the script that records it
 *   (queues/runtime/lua/outcome-finish.lua), with the final record itself when it is small;
 * - a sample's end is published by the agent once BullMQ has recorded it (`sampleEndSignal`, in
 *   the transaction that records the job's metrics), with its result or failure when small.
 * The waiter answers from a record without reading it back. A waiter is registered before the
 * caller reads the state, so a signal sent between the two is not lost. A `retrieve_futures` poll
 * (the SDK's session poller) waits the same way for any sample of its sampling session's client
 * (`watchSession`), recognised by its job id, then reads that client's log (queues/runtime/session-futures.ts).
 *
 * When the agent runs in the same process as the API (`tinker-broker start`), whoever sends a signal
 * also hands it to this process's waiters at once: the answer does not wait for the message to come
 * back from Redis on the subscriber connection. A sample's end is handed over once BullMQ has
 * recorded it (`signalLocally`); a training op's outcome, by the agent that ran it, just before its
 * record is sent to Redis (`handOverLocally`, queues/runtime/outcomes.ts Outcomes.finish with `early`): the
 * waiter answers, then the script records it and applies the read-once expiry the waiter registered
 * (`watch`), so a record read leaves Redis as it would after a read back. The message still goes to
 * Redis for every other API process; a waiter woken twice answers once.
 */

/** The keys a future's read leaves Redis by, within `ms` (its read-once expiry, api/futures.ts). */
export type ReadOnceExpiry = { keys: string[]; ms: number };

/**
 * What wakes a waiter: the final record when the signal carried it (as JSON, or, handed over in this
 * process, the record itself), and whether its sender applies the waiter's read-once expiry.
 */
export type Wake = { record?: string | Outcome; expiryTaken: boolean };

/**
 * A final record up to this size travels in its completion signal (queues/runtime/lua/outcome-finish.lua,
 * `sampleEndSignal`), so a waiting retrieve_future answers without reading it back; a larger one is
 * read from Redis.
 */
export const SIGNALLED_RECORD_MAX_BYTES = 64 * 1024;

/** How a sample job ended, as its completion signal carries it. */
export type SampleEnd = { state: 'done'; result: unknown } | ({ state: 'failed' } & Failure);

/**
 * The channel and message that signal a sample job's end: the end as a final record of the
 * outcome's shape (queues/runtime/outcomes.ts; not stored anywhere) when it is at most
 * SIGNALLED_RECORD_MAX_BYTES, else the job id alone (the waiter then reads the finished job).
 * Send it after the job's end is recorded in Redis.
 */
export function sampleEndSignal(names: Names, jobId: string, agentId: string, end: SampleEnd): [channel: string, message: string] {
  const record: Outcome = { ...end, op: 'sample', agent_id: agentId, token: jobId, at: new Date().toISOString() };
  return [names.outcomesChannel(), signalMessage(jobId, JSON.stringify(record))];
}

/** A signal's message: the job id and the final record when the record is at most SIGNALLED_RECORD_MAX_BYTES, else the job id alone. */
export function signalMessage(jobId: string, recordJson: string): string {
  const small = recordJson.length <= SIGNALLED_RECORD_MAX_BYTES && Buffer.byteLength(recordJson) <= SIGNALLED_RECORD_MAX_BYTES;
  return small ? `${jobId} ${recordJson}` : jobId;
}

/** This process's subscribed Completions, by channel (a deployment's prefix; tests run several in one process). */
const local = new Map<string, Set<Completions>>();

/**
 * Hands a completion signal (`<job id>` or `<job id> <final record>`, as published) to the waiters
 * of this process on `channel`. Call it once the end is recorded in Redis, beside the publish.
 */
export function signalLocally(channel: string, message: string): void {
  for (const c of local.get(channel) ?? []) c.deliver(message, true);
}

/**
 * Training ops that an agent of this process runs and will hand over (handOverLocally) when it ends
 * them: a submit here handed the op's job to its consumer here (queues/runtime/train-consumer.ts handOff).
 * By `<channel> <job id>`, the tenant the future was issued to. A retrieve_future here for such an
 * op waits for the hand-over without reading Redis (api/futures.ts): the agent ends every op it
 * runs with one (a failure too), or lets it go (handOverDone). As for any early hand-over, the
 * answer is what ran, even in the rare case that a reaper elsewhere counted this process's agent
 * dead meanwhile and failed the op in Redis.
 */
const expected = new Map<string, string>();

/** An op this process's agent now runs, submitted by `tenant` through this process. */
export function expectHandOver(channel: string, jobId: string, tenant: string): void {
  expected.set(`${channel} ${jobId}`, tenant);
}

/** The tenant of an op this process's agent runs and will hand over, if it is one. */
export function handOverExpected(channel: string, jobId: string): string | undefined {
  return expected.get(`${channel} ${jobId}`);
}

/**
 * The agent is done with the op (its consumer let the job go): when it was not handed over (not run,
 * or ended without an early record), the waiters here are woken without a record, to read Redis.
 */
export function handOverDone(channel: string, jobId: string): void {
  if (!expected.delete(`${channel} ${jobId}`)) return;
  for (const c of local.get(channel) ?? []) c.wakeAll(jobId);
}

/**
 * Hands a training op's final record to the waiters of this process on `channel` before it is
 * recorded (queues/runtime/outcomes.ts Outcomes.finish, early): how many it woke, the read-once expiries
 * they registered, for the script that records it to apply, how many subscriptions of this
 * process it went through (the script sends no message when they are the channel's only ones), and
 * the tenant its future was issued to when a submit here handed the op to this process's agent.
 */
export function handOverLocally(
  channel: string,
  jobId: string,
  record: Outcome,
): { woken: number; ownerWoken: boolean; expiries: ReadOnceExpiry[]; subscriptions: number; tenant: string | undefined } {
  const key = `${channel} ${jobId}`;
  const tenant = expected.get(key);
  expected.delete(key);
  const expiries: ReadOnceExpiry[] = [];
  let woken = 0;
  let owners = 0;
  const mine = local.get(channel) ?? new Set();
  for (const c of mine) {
    const n = c.wakeAll(jobId, record, expiries, tenant);
    woken += n.woken;
    owners += n.owners;
  }
  return { woken, ownerWoken: owners > 0, expiries, subscriptions: mine.size, tenant };
}

/**
 * Final records of ops that this process's agent ran for a submit here and handed over while no
 * waiter here waited for them: the client's retrieve_future usually comes a moment later (the SDK
 * asks for the result after its submit's answer, and a short op ends first) and answers from here
 * without reading Redis (`takeKept`). Kept from the hand-over, while the record is on its way to
 * Redis (`written` settles once the script that records it has answered; a read-once expiry goes
 * after it), until the first read, for at most KEPT_RECORD_MS; the newest KEPT_RECORDS_MAX of them,
 * each small enough to travel in a completion signal (a larger one is read from Redis). A record
 * that lost to another one standing in Redis (the reaper's OUTCOME_UNKNOWN) is no longer kept once
 * that is known (`dropKept`): a read before that answers what ran, as a waiter handed it does. By
 * `<channel> <job id>`, in the order kept.
 */
const kept = new Map<string, { tenant: string; record: Outcome; written: Promise<void>; until: number }>();
export const KEPT_RECORD_MS = 10_000;
export const KEPT_RECORDS_MAX = 256;

/** Keeps a record handed over with no one waiting for the first read of its future here, by `tenant` (Outcomes.finish). */
export function keepHandedOver(channel: string, jobId: string, tenant: string, record: Outcome, written: Promise<void>, now = Date.now()): void {
  const key = `${channel} ${jobId}`;
  kept.delete(key);
  kept.set(key, { tenant, record, written, until: now + KEPT_RECORD_MS });
  for (const [k, v] of kept) {
    if (kept.size <= KEPT_RECORDS_MAX && v.until > now) break;
    kept.delete(k);
  }
}

/** The record is not kept any longer (another record stands in Redis). */
export function dropKept(channel: string, jobId: string): void {
  kept.delete(`${channel} ${jobId}`);
}

/**
 * The record kept for the op's first read, when `tenant` is the one its future was issued to (it is
 * then no longer kept), with `written`, which settles once the script writing it to Redis has answered.
 */
export function takeKept(channel: string, jobId: string, tenant: string, now = Date.now()): { record: Outcome; written: Promise<void> } | undefined {
  const key = `${channel} ${jobId}`;
  const k = kept.get(key);
  if (!k || k.tenant !== tenant) return undefined;
  kept.delete(key);
  return k.until > now ? { record: k.record, written: k.written } : undefined;
}

/**
 * Samples submitted through this process whose ends have not been signalled here yet (api/futures.ts
 * expectSample: a retrieve_future of one, here, for its tenant, waits for the signal without reading
 * its state first). By `<channel> <job id>`, the tenant its future was issued to; the newest
 * EXPECTED_SAMPLES_MAX (an older one forgotten is read from Redis, as without this). When one's end
 * comes with its record (`Completions.deliver`: the agent sends it once BullMQ has recorded the end,
 * so Redis holds the same) and no retrieve_future of its tenant waits here for it (the SDK's session
 * poller reports the end first, then the client fetches the result; or the client is late), the
 * record is kept for the first read of its future here (`takeKeptSample`), for at most
 * KEPT_RECORD_MS, within KEPT_SAMPLE_BYTES_MAX of records in all (the oldest go first): that read
 * answers without the state script's round trip.
 */
const expectedSamples = new Map<string, string>();
const keptSamples = new Map<string, { tenant: string; record: string; until: number }>();
let keptSampleBytes = 0;
export const EXPECTED_SAMPLES_MAX = 16_384;
export const KEPT_SAMPLE_BYTES_MAX = 32 * 1024 * 1024;

/** A sample about to be submitted here by `tenant`: its end is expected here (call it only while a subscription on `channel` is live). */
export function expectSampleEnd(channel: string, jobId: string, tenant: string, now = Date.now()): void {
  const key = `${channel} ${jobId}`;
  expectedSamples.delete(key);
  expectedSamples.set(key, tenant);
  if (expectedSamples.size > EXPECTED_SAMPLES_MAX) expectedSamples.delete(expectedSamples.keys().next().value!);
  sweepKeptSamples(now);
}

/** The tenant of a sample submitted here whose end is expected (expectSampleEnd); it is then expected no longer. */
function takeExpectedSample(channel: string, jobId: string): string | undefined {
  const key = `${channel} ${jobId}`;
  const tenant = expectedSamples.get(key);
  expectedSamples.delete(key);
  return tenant;
}

/** The tenant of a sample submitted here whose end has not been signalled here yet (expectSampleEnd), if it is one. */
export function expectedSampleTenant(channel: string, jobId: string): string | undefined {
  return expectedSamples.get(`${channel} ${jobId}`);
}

/** A sample submitted here will not end as expected (refused, or its end may come while no signal can): forgotten. */
export function forgetExpectedSample(channel: string, jobId: string): void {
  expectedSamples.delete(`${channel} ${jobId}`);
}

/** Every expectation on `channel` is forgotten: its subscription broke, so their ends' signals may be lost. */
function forgetExpectedSamples(channel: string): void {
  const prefix = `${channel} `;
  for (const k of expectedSamples.keys()) if (k.startsWith(prefix)) expectedSamples.delete(k);
}

/** Keeps a signalled sample end's record (JSON) for the first read of its future here by `tenant`. */
export function keepSampleEnd(channel: string, jobId: string, tenant: string, record: string, now = Date.now()): void {
  const key = `${channel} ${jobId}`;
  dropKeptSample(key);
  keptSamples.set(key, { tenant, record, until: now + KEPT_RECORD_MS });
  keptSampleBytes += record.length;
  sweepKeptSamples(now);
}

/** The kept sample records past their time, and the oldest beyond KEPT_SAMPLE_BYTES_MAX, leave. */
function sweepKeptSamples(now: number): void {
  for (const [k, v] of keptSamples) {
    if (keptSampleBytes <= KEPT_SAMPLE_BYTES_MAX && v.until > now) break;
    dropKeptSample(k);
  }
}

function dropKeptSample(key: string): void {
  const k = keptSamples.get(key);
  if (!k) return;
  keptSamples.delete(key);
  keptSampleBytes -= k.record.length;
}

/**
 * The final record (JSON) of a sample submitted here, for the first read of its future, when
 * `tenant` is the one its future was issued to (it is then no longer kept).
 */
export function takeKeptSample(channel: string, jobId: string, tenant: string, now = Date.now()): string | undefined {
  const key = `${channel} ${jobId}`;
  const k = keptSamples.get(key);
  if (!k || k.tenant !== tenant) return undefined;
  dropKeptSample(key);
  return k.until > now ? k.record : undefined;
}

/** What this process keeps of sample ends: expected ends, records kept, and their bytes (record lengths). */
export function keptSampleStats(): { expected: number; kept: number; bytes: number } {
  return { expected: expectedSamples.size, kept: keptSamples.size, bytes: keptSampleBytes };
}

export class Completions {
  private subscriber: Promise<Redis> | null = null;
  private readonly waiters = new Map<string, Set<{ wake: (w: Wake) => void; expiry?: ReadOnceExpiry | undefined; tenant: string }>>();

  constructor(
    private readonly blockingConnection: () => Redis,
    private readonly names: Names,
  ) {}

  /** Polls of sampling sessions' logs (`watchSession`), by `sessionSignalKey`. */
  private readonly sessionWaiters = new Map<string, Set<{ wake: (() => void) | null }>>();

  /**
   * A signal's message: '<job id>' or '<job id> <final outcome record>' (job ids hold no space).
   * `local`: handed over in this process (signalLocally) before the sender's transaction ran, so
   * before a sample's log entry is in Redis: polls of session logs wait for the message from Redis.
   */
  deliver(msg: string, local = false): void {
    const sp = msg.indexOf(' ');
    const jobId = sp === -1 ? msg : msg.slice(0, sp);
    if (sp === -1) {
      // An end too large to travel: nothing kept, the future is read from Redis.
      if (expectedSamples.size > 0) forgetExpectedSample(this.names.outcomesChannel(), msg);
      this.wakeAll(msg);
    } else {
      const record = msg.slice(sp + 1);
      const channel = this.names.outcomesChannel();
      // A sample submitted here: its record is kept for its client's fetch, unless that client's retrieve_future waits here now.
      const tenant = expectedSamples.size > 0 ? takeExpectedSample(channel, jobId) : undefined;
      if (this.wakeAll(jobId, record, undefined, tenant).owners === 0 && tenant !== undefined) keepSampleEnd(channel, jobId, tenant, record);
    }
    if (!local && this.sessionWaiters.size > 0) this.wakeSession(jobId);
  }

  /** Wakes the polls of the sampling session's client whose sample the job is, if any wait here. */
  private wakeSession(jobId: string): void {
    const key = sessionSignalKeyOfJob(jobId);
    for (const w of (key !== null && this.sessionWaiters.get(key)) || []) {
      w.wake?.();
      w.wake = null;
    }
  }

  /**
   * Registers a poll of a sampling session's client's log (api/futures.ts `sessionFutures`), by its
   * `sessionSignalKey`: `next()` resolves on the first signal of one of the client's samples after
   * the call, so a poll arms it before it reads the log and misses no entry added after that read.
   * Only messages from Redis wake it: one comes for every sample's end once its entry is written
   * (a hand-over in this process, `signalLocally`, comes before that). `cancel` removes the waiter.
   */
  async watchSession(key: string): Promise<{ next: () => Promise<void>; cancel: () => void }> {
    await this.subscribe();
    const w: { wake: (() => void) | null } = { wake: null };
    const set = this.sessionWaiters.get(key) ?? new Set();
    set.add(w);
    this.sessionWaiters.set(key, set);
    return {
      next: () => new Promise<void>((resolve) => (w.wake = resolve)),
      cancel: () => {
        w.wake = null;
        set.delete(w);
        if (set.size === 0 && this.sessionWaiters.get(key) === set) this.sessionWaiters.delete(key);
      },
    };
  }

  /**
   * Wakes the job's waiters and returns how many; with `expiries` (handOverLocally) each one woken
   * with a record adds its read-once expiry.
   */
  wakeAll(jobId: string, record?: string | Outcome, expiries?: ReadOnceExpiry[], owner?: string): { woken: number; owners: number } {
    const set = this.waiters.get(jobId) ?? new Set();
    let owners = 0;
    for (const w of set) {
      const taken = expiries !== undefined && record !== undefined && w.expiry !== undefined;
      if (taken) expiries.push(w.expiry!);
      if (w.tenant === owner) owners++;
      w.wake({ ...(record !== undefined ? { record } : {}), expiryTaken: taken });
    }
    return { woken: set.size, owners };
  }

  /** Resolves once this process's subscription is made (it is made once, on first need). */
  async listen(): Promise<void> {
    await this.subscribe();
  }

  /**
   * Whether the subscription is made and has not broken since: every signal sent from now on
   * reaches this process (the condition for expecting a sample's end, expectSampleEnd). When its
   * connection closes, the signals sent until it is subscribed again are lost: the expectations on
   * its channel are forgotten, and none is made until the subscription is made again.
   */
  get live(): boolean {
    return this.subscribed;
  }
  private subscribed = false;

  private subscribe(): Promise<Redis> {
    if (!this.subscriber) {
      const p = (async () => {
        const c = this.blockingConnection();
        c.on('message', (_channel: string, msg: string) => this.deliver(msg));
        const channel = this.names.outcomesChannel();
        c.on('close', () => {
          this.subscribed = false;
          forgetExpectedSamples(channel);
        });
        // ioredis subscribes again after a reconnect; the answer to a subscribe of our own says when that is done.
        c.on('ready', () => {
          if (!this.subscribed && this.subscriber === p) c.subscribe(channel).then(() => (this.subscribed = this.subscriber === p), () => undefined);
        });
        await c.subscribe(channel);
        this.subscribed = true;
        const mine = local.get(channel) ?? new Set();
        mine.add(this);
        local.set(channel, mine);
        return c;
      })();
      this.subscriber = p;
      // A subscription that failed is dropped, so the next wait tries again.
      p.catch(() => (this.subscriber = null));
    }
    return this.subscriber;
  }

  /**
   * Registers a waiter for the job's end; `woken` resolves on its signal, with the final record
   * (JSON) when the signal carried it. Resolves once the signal can no longer be missed (read the
   * state after this), for `tenant`, the one whose retrieve_future it is. `owns(expiry)`, once that
   * read found the future pending for `tenant` (so issued to it): the read-once expiry an early
   * signal's sender applies for this waiter from then on (`expiryTaken`). A waiter that never owns
   * one (another tenant's, whose read answers unknown) leaves the record's lifetime as it is.
   * `cancel` removes the waiter.
   */
  async watch(ref: FutureRef, tenant: string): Promise<{ woken: Promise<Wake>; owns: (expiry: ReadOnceExpiry | undefined) => void; cancel: () => void }> {
    await this.subscribe();
    let wake!: (w: Wake) => void;
    const woken = new Promise<Wake>((resolve) => (wake = resolve));
    const set = this.waiters.get(ref.jobId) ?? new Set();
    const w: { wake: (w: Wake) => void; expiry?: ReadOnceExpiry | undefined; tenant: string } = { wake, tenant };
    set.add(w);
    this.waiters.set(ref.jobId, set);
    return {
      woken,
      owns: (expiry) => (w.expiry = expiry),
      cancel: () => {
        set.delete(w);
        if (set.size === 0 && this.waiters.get(ref.jobId) === set) this.waiters.delete(ref.jobId);
      },
    };
  }

  async close(): Promise<void> {
    const sub = this.subscriber;
    this.subscriber = null;
    this.subscribed = false;
    const channel = this.names.outcomesChannel();
    local.get(channel)?.delete(this);
    if (local.get(channel)?.size === 0) local.delete(channel);
    if (sub) await sub.then((c) => c.unsubscribe().catch(() => undefined)).catch(() => undefined);
  }
}
