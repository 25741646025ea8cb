import type { ChainableCommander, Redis } from 'ioredis';
import { z } from 'zod';
import type { ErrorCategory, ErrorCode, Failure } from '../contract/errors.js';
import { decodeRequestId, encodeRequestId } from '../contract/futures.js';
import { jobIds, type Names } from '../contract/names.js';

/**
 * What `retrieve_futures` reads: per client of a sampling session, the samples that ended and that
 * the client's poller has not acknowledged yet. The SDK (0.27+, when `/client/config` says
 * `sample_use_retrieve_futures`) runs one poller per SamplingClient; a sample's future waits for
 * the poller to report its request, then fetches the result with `retrieve_future` as before.
 *
 * The log is a Redis stream (`Names.sessionFutures`) whose entry ids are `0-<n>`: Redis numbers
 * them 1, 2, 3… in the order they are added, and `n` is the cursor the SDK passes back. Whoever
 * records a sample's end adds its entry in the same transaction (the agent with the job's metrics
 * and completion signal, workers/agent/samples.ts; the API for a sample refused before it was
 * queued, api/services/sampling.ts), so an entry is in Redis before the signal that wakes a poll.
 * A poll first drops the entries at or before its cursor (the acknowledgement), then reads the next
 * ones (`readSessionFutures`).
 *
 * Only samples that name a sampling session and an exact seq_id are logged: the SDK's (its seq_ids
 * for a clone are 1e9·clone + 0, 1, 2…). The log holds at most SESSION_FUTURES_MAX entries: past
 * that the oldest go (a client that stopped polling, or one that never polls), and their results
 * stay readable with `retrieve_future`.
 *
 * The SDK waits for every sample on its poller, with no other way to learn of its end, so a sample
 * that ends without its entry (its agent died between BullMQ's record of the end and its own
 * transaction; a job failed or removed by anything but its agent) would leave its future waiting
 * forever. Hence the pending set (`Names.sessionPending`): the API adds a sample's request id when
 * it queues it (`trackPendingSample`, sent before the job), the entry's transaction removes it, and
 * a poll with nothing to report reconciles the client (`reconcileSessionFutures`, at most every
 * SESSION_RECONCILE_EVERY_MS per client): each pending sample whose job has ended, failed or gone
 * gets its entry there. Reconcile moves the id to the reconciled set (`Names.sessionReconciled`) in
 * the transaction that adds its entry, and only when the id was still pending: a sample is
 * reconciled at most once, never after its agent's entry, and its agent's entry that comes after
 * is not reported (`readSessionFutures`).
 */

/** Entries a client's log holds at most (the oldest leave first); a poller that keeps up holds a few. */
export const SESSION_FUTURES_MAX = 10_000;
/** Entries one `retrieve_futures` answer carries at most; the poller asks again at once for the rest. */
export const SESSION_FUTURES_PER_POLL = 1_000;
/** A failed entry carries the first this many characters of the failure's message (retrieve_future has all of it). */
export const SESSION_FAILURE_MESSAGE_MAX = 1_024;
/** The SDK numbers a SamplingClient clone's seq_ids from 1e9·clone (its cloned_sampler_id). */
export const CLONE_SEQ_SPAN = 1_000_000_000;
/** Samples a client's pending set holds at most; one queued beyond it is reported by its agent only. */
export const SESSION_PENDING_MAX = 10_000;
/** Pending samples one reconcile looks at, at most (the next one goes on from there). */
export const SESSION_RECONCILE_BATCH = 256;
/** A client's samples are reconciled at most this often (ms), by one poll at a time across API processes. */
export const SESSION_RECONCILE_EVERY_MS = 3_000;
/** Reconciled request ids a client's set holds at most (one dropped early can only let its agent's late entry be reported twice). */
export const SESSION_RECONCILED_MAX = 10_000;

/** One entry of a `retrieve_futures` answer, as SDK 0.38 reads it (`FutureCompletion`), failures with the Tinker error shape. */
export type SessionFuture =
  | { state: 'finished'; request_id: string }
  | { state: 'failed'; request_id: string; error: string; category: ErrorCategory; code: ErrorCode };

/** A `retrieve_futures` answer: the entries after the client's cursor, and the cursor to pass back. */
export type SessionFutures = { completions: SessionFuture[]; cursor: number };

/** How a sample ended, for its entry. */
export type SessionEnd = { state: 'done' } | ({ state: 'failed' } & Failure);

/** The client (cloned_sampler_id) that sent a seq_id. */
export function cloneOf(seqId: number): number {
  return Math.floor(seqId / CLONE_SEQ_SPAN);
}

/** The keys of one client of a sampling session: its log, its pending and reconciled samples, its reconcile turn. */
export type SessionKeys = { log: string; pending: string; reconciled: string; turn: string };

/** The keys of a sampling session's client (`clone`: its cloned_sampler_id). */
export function sessionKeys(names: Names, samplingSessionId: string, clone: number): SessionKeys {
  return {
    log: names.sessionFutures(samplingSessionId, clone),
    pending: names.sessionPending(samplingSessionId, clone),
    reconciled: names.sessionReconciled(samplingSessionId, clone),
    turn: names.sessionReconcileTurn(samplingSessionId, clone),
  };
}

/**
 * The keys of the client a sample job reports its end to: its sampling session's, for the clone of
 * its seq_id, when the job id is the one the API gives that (session, seq_id); null for any other
 * sample (one without a session or an exact seq_id has no poller that could ask for it).
 */
export function sessionKeysOfJob(names: Names, jobId: string, job: { sampling_session_id: string; seq_id: number }): SessionKeys | null {
  // The job's data crossed Redis: checked before it names a key.
  if (typeof job.sampling_session_id !== 'string' || !Number.isSafeInteger(job.seq_id) || job.seq_id < 0) return null;
  if (jobIds.sample(job.sampling_session_id, job.seq_id) !== jobId) return null;
  return sessionKeys(names, job.sampling_session_id, cloneOf(job.seq_id));
}

/**
 * How a poll waiting on a client's log recognises the completion signals of its samples
 * (queues/runtime/completions.ts `watchSession`): the job id without its seq_id, and the clone.
 */
export function sessionSignalKey(samplingSessionId: string, clone: number): string {
  return `${jobIds.sample(samplingSessionId, 0).slice(0, -1)}${clone}`;
}

/** The `sessionSignalKey` of a signalled job, when it is a sample of a sampling session (else null). */
export function sessionSignalKeyOfJob(jobId: string): string | null {
  if (!jobId.startsWith('s-')) return null;
  const dash = jobId.lastIndexOf('-');
  const seq = jobId.slice(dash + 1);
  if (!/^\d{1,16}$/.test(seq)) return null;
  return `${jobId.slice(0, dash + 1)}${cloneOf(Number(seq))}`;
}

/** The stream fields of an entry (short names: a log may hold thousands). */
function entryFields(requestId: string, end: SessionEnd): string[] {
  if (end.state === 'done') return ['r', requestId, 's', 'finished'];
  return ['r', requestId, 's', 'failed', 'c', end.category, 'k', end.code, 'm', end.message.slice(0, SESSION_FAILURE_MESSAGE_MAX)];
}

/** The field that marks an entry a reconcile wrote (`o: r`); its agent's entry may follow, and is not reported. */
const RECONCILED_FIELDS = ['o', 'r'];

/**
 * Adds a sample's end to its client's log in `m` (a transaction or pipeline of the caller, before
 * the completion signal it sends), and restarts the log's lifetime (`ttlS`: the retention).
 */
export function addSessionFuture(m: ChainableCommander, key: string, requestId: string, end: SessionEnd, ttlS: number): void {
  m.xadd(key, 'MAXLEN', '=', SESSION_FUTURES_MAX, '0-*', ...entryFields(requestId, end));
  m.pexpire(key, ttlS * 1000);
}

/**
 * A sample job's end, added to its sampling session's log (when it has one, `sessionKeysOfJob`) in
 * `m`, the transaction that sends its completion signal after it; the sample leaves the pending set
 * in the same transaction.
 */
export function addSampleEnd(
  m: ChainableCommander,
  names: Names,
  job: { id: string; queue: string; sampling_session_id: string; seq_id: number },
  end: SessionEnd,
  ttlS: number,
): void {
  const keys = sessionKeysOfJob(names, job.id, job);
  if (keys === null) return;
  const requestId = encodeRequestId({ queue: job.queue, jobId: job.id });
  m.srem(keys.pending, requestId);
  addSessionFuture(m, keys.log, requestId, end, ttlS);
}

/**
 * A sample that failed before it was queued (its failed-future record written): its entry, and a
 * completion signal (the job id alone) that wakes the polls and retrieve_futures waiting for it.
 */
export async function reportRefusedSample(
  redis: Redis,
  names: Names,
  job: { id: string; queue: string; sampling_session_id: string; seq_id: number },
  failure: Failure,
  ttlS: number,
): Promise<void> {
  if (sessionKeysOfJob(names, job.id, job) === null) return;
  const m = redis.multi();
  addSampleEnd(m, names, job, { state: 'failed', ...failure }, ttlS);
  m.publish(names.outcomesChannel(), job.id);
  await m.exec();
}

/**
 * A sample about to be queued for a client of a sampling session: its request id joins the
 * client's pending set (restarting its lifetime, `ttlS`), and leaves the reconciled set (a request
 * queued again is reported again). Its transaction is sent before this returns, so a job queued
 * after this call on the same connection cannot end before the id is pending. Beyond
 * SESSION_PENDING_MAX the id leaves again: that sample is reported by its agent only. Resolves to
 * whether the id is tracked (false too for a sample no poller can ask for).
 */
export function trackPendingSample(
  redis: Redis,
  names: Names,
  job: { id: string; queue: string; sampling_session_id: string; seq_id: number },
  ttlS: number,
): Promise<boolean> {
  const keys = sessionKeysOfJob(names, job.id, job);
  if (keys === null) return Promise.resolve(false);
  const requestId = encodeRequestId({ queue: job.queue, jobId: job.id });
  const sent = redis.multi().sadd(keys.pending, requestId).srem(keys.reconciled, requestId).pexpire(keys.pending, ttlS * 1000).scard(keys.pending).exec();
  return (async () => {
    const size = Number(execResults(await sent, keys.pending)[3]);
    if (size <= SESSION_PENDING_MAX) return true;
    await redis.srem(keys.pending, requestId);
    return false;
  })();
}

/** The sample queued after `trackPendingSample` was refused (nothing was queued): it leaves the pending set. */
export async function untrackPendingSample(redis: Redis, names: Names, job: { id: string; queue: string; sampling_session_id: string; seq_id: number }): Promise<void> {
  const keys = sessionKeysOfJob(names, job.id, job);
  if (keys !== null) await redis.srem(keys.pending, encodeRequestId({ queue: job.queue, jobId: job.id }));
}

const Entry = z.discriminatedUnion('s', [
  z.object({ r: z.string(), s: z.literal('finished'), o: z.literal('r').optional() }),
  z.object({ r: z.string(), s: z.literal('failed'), c: z.enum(['user', 'server', 'unknown']), k: z.string(), m: z.string(), o: z.literal('r').optional() }),
]);

/** An entry as read: what it reports, and whether a reconcile wrote it. */
function toFuture(fields: string[]): { future: SessionFuture; reconciled: boolean } | null {
  const o: Record<string, string> = {};
  for (let i = 0; i + 1 < fields.length; i += 2) o[fields[i]!] = fields[i + 1]!;
  const e = Entry.safeParse(o);
  if (!e.success) return null;
  const reconciled = e.data.o === 'r';
  if (e.data.s === 'finished') return { future: { state: 'finished', request_id: e.data.r }, reconciled };
  return { future: { state: 'failed', request_id: e.data.r, error: e.data.m, category: e.data.c, code: e.data.k as ErrorCode }, reconciled };
}

/** The replies of a transaction, or its first error (a discarded one is an error too). */
function execResults(res: [Error | null, unknown][] | null, what: string): unknown[] {
  const failed = res?.find(([err]) => err);
  if (!res || failed) throw failed?.[0] ?? new Error(`the transaction on ${what} was discarded`);
  return res.map(([, v]) => v);
}

/**
 * One poll of a client's log: the entries at or before `prevCursor` leave (the client has them),
 * the next ones (at most SESSION_FUTURES_PER_POLL) are read, and the log's lifetime restarts, in
 * one round trip (a second one only while the client has reconciled samples). An entry of its agent
 * for a sample that a reconcile reported already is skipped. The cursor answered is the last
 * entry's, or `prevCursor` when there is none.
 */
export async function readSessionFutures(redis: Redis, keys: SessionKeys, prevCursor: number, ttlS: number): Promise<SessionFutures> {
  const res = execResults(
    await redis
      .multi()
      .xtrim(keys.log, 'MINID', `0-${prevCursor + 1}`)
      .xrange(keys.log, `(0-${prevCursor}`, '+', 'COUNT', SESSION_FUTURES_PER_POLL)
      .pexpire(keys.log, ttlS * 1000)
      .scard(keys.reconciled)
      .exec(),
    `retrieve_futures read of ${keys.log}`,
  );
  const entries = (res[1] ?? []) as [string, string[]][];
  const read: { future: SessionFuture; reconciled: boolean }[] = [];
  let cursor = prevCursor;
  for (const [id, fields] of entries) {
    cursor = Number(id.slice(id.indexOf('-') + 1));
    const f = toFuture(fields);
    if (f) read.push(f);
  }
  // An agent's entry after a reconcile wrote one for its sample (the reconcile came first: the id was still pending).
  const agents = read.filter((f) => !f.reconciled).map((f) => f.future.request_id);
  const skip = new Set<string>();
  if (Number(res[3]) > 0 && agents.length > 0) {
    const marked = await redis.smismember(keys.reconciled, ...agents);
    agents.forEach((id, i) => marked[i] && skip.add(id));
  }
  return { completions: read.filter((f) => f.reconciled || !skip.has(f.future.request_id)).map((f) => f.future), cursor };
}

/**
 * How a pending sample stands, as its future reads (api/futures.ts): its end, or null while it has
 * none (queued or running).
 */
export type PendingState = (requestId: string) => Promise<SessionEnd | null>;

/**
 * One reconcile of a client: the pending samples from the set's scan cursor `from` ('0': its
 * start), at most SESSION_RECONCILE_BATCH, are read with `stateOf`; each that has an end gets its
 * entry (marked as a reconcile's) in one transaction that moves the id from the pending set to the
 * reconciled set and signals the job's end (waking the polls and retrieve_futures waiting on it).
 * An id another writer took out of the pending set in the meantime (its agent's entry, or another
 * reconcile) keeps that writer's entry: this one's is deleted again. Returns how many entries were
 * added and the scan cursor to go on from ('0': the scan is over).
 */
export async function reconcileSessionFutures(
  redis: Redis,
  names: Names,
  keys: SessionKeys,
  stateOf: PendingState,
  ttlS: number,
  from = '0',
): Promise<{ added: number; next: string }> {
  const ids = new Set<string>();
  let next = from;
  do {
    const [cursor, members] = await redis.sscan(keys.pending, next, 'COUNT', SESSION_RECONCILE_BATCH);
    next = cursor;
    for (const m of members) if (ids.size < SESSION_RECONCILE_BATCH) ids.add(m);
  } while (next !== '0' && ids.size < SESSION_RECONCILE_BATCH);
  const states = await Promise.all([...ids].map(async (id) => [id, await stateOf(id)] as const));
  const ended = states.filter((s): s is readonly [string, SessionEnd] => s[1] !== null);
  if (ended.length === 0) return { added: 0, next };

  const m = redis.multi();
  for (const [id, end] of ended) {
    m.smove(keys.pending, keys.reconciled, id);
    m.xadd(keys.log, 'MAXLEN', '=', SESSION_FUTURES_MAX, '0-*', ...entryFields(id, end), ...RECONCILED_FIELDS);
  }
  m.pexpire(keys.log, ttlS * 1000).pexpire(keys.reconciled, ttlS * 1000).scard(keys.reconciled);
  for (const [id] of ended) m.publish(names.outcomesChannel(), decodeRequestId(id)?.jobId ?? id);
  const res = execResults(await m.exec(), `reconcile of ${keys.pending}`);
  // Ids no longer pending when the transaction ran: their entries were written by another; these go.
  const lost = ended.map((_, i) => (Number(res[2 * i]) === 1 ? null : String(res[2 * i + 1]))).filter((e): e is string => e !== null);
  if (lost.length > 0) await redis.xdel(keys.log, ...lost);
  const marked = Number(res[2 * ended.length + 2]);
  if (marked > SESSION_RECONCILED_MAX) await redis.spop(keys.reconciled, marked - SESSION_RECONCILED_MAX);
  return { added: ended.length - lost.length, next };
}
