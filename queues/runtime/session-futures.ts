import type { ChainableCommander, Redis } from 'ioredis';
import { z } from 'zod';
import type { ErrorCategory, ErrorCode, Failure } from '../contract/errors.js';
import { encodeRequestId } from '../contract/futures.js';
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
 */

/** Entries a client's log holds at most (the oldest leave first); a poller that keeps up holds a few. */
export const SESSION_FUTURES_MAX = 10_000;
/** Entries one `retrieve_futures` answer carries at most; the poller asks again at once for the rest. */
export const SESSION_FUTURES_PER_POLL = 1_000;
/** A failed entry carries the first this many characters of the failure's message (retrieve_future has all of it). */
export const SESSION_FAILURE_MESSAGE_MAX = 1_024;
/** The SDK numbers a SamplingClient clone's seq_ids from 1e9·clone (its cloned_sampler_id). */
export const CLONE_SEQ_SPAN = 1_000_000_000;

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

/**
 * The log a sample job reports its end to: its sampling session's, for the clone of its seq_id,
 * when the job id is the one the API gives that (session, seq_id); null for any other sample
 * (one without a session or an exact seq_id has no poller that could ask for it).
 */
export function sessionFuturesKey(names: Names, jobId: string, job: { sampling_session_id: string; seq_id: number }): string | null {
  // The job's data crossed Redis: checked before it names a key.
  if (typeof job.sampling_session_id !== 'string' || !Number.isSafeInteger(job.seq_id) || job.seq_id < 0) return null;
  if (jobIds.sample(job.sampling_session_id, job.seq_id) !== jobId) return null;
  return names.sessionFutures(job.sampling_session_id, cloneOf(job.seq_id));
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

/**
 * Adds a sample's end to its client's log in `m` (a transaction or pipeline of the caller, before
 * the completion signal it sends), and restarts the log's lifetime (`ttlS`: the retention).
 */
export function addSessionFuture(m: ChainableCommander, key: string, requestId: string, end: SessionEnd, ttlS: number): void {
  m.xadd(key, 'MAXLEN', '=', SESSION_FUTURES_MAX, '0-*', ...entryFields(requestId, end));
  m.pexpire(key, ttlS * 1000);
}

/**
 * A sample job's end, added to its sampling session's log (when it has one, `sessionFuturesKey`)
 * in `m`, the transaction that sends its completion signal after it.
 */
export function addSampleEnd(
  m: ChainableCommander,
  names: Names,
  job: { id: string; queue: string; sampling_session_id: string; seq_id: number },
  end: SessionEnd,
  ttlS: number,
): void {
  const key = sessionFuturesKey(names, job.id, job);
  if (key !== null) addSessionFuture(m, key, encodeRequestId({ queue: job.queue, jobId: job.id }), end, ttlS);
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
  if (sessionFuturesKey(names, job.id, job) === null) return;
  const m = redis.multi();
  addSampleEnd(m, names, job, { state: 'failed', ...failure }, ttlS);
  m.publish(names.outcomesChannel(), job.id);
  await m.exec();
}

const Entry = z.discriminatedUnion('s', [
  z.object({ r: z.string(), s: z.literal('finished') }),
  z.object({ r: z.string(), s: z.literal('failed'), c: z.enum(['user', 'server', 'unknown']), k: z.string(), m: z.string() }),
]);

function toFuture(fields: string[]): SessionFuture | null {
  const o: Record<string, string> = {};
  for (let i = 0; i + 1 < fields.length; i += 2) o[fields[i]!] = fields[i + 1]!;
  const e = Entry.safeParse(o);
  if (!e.success) return null;
  if (e.data.s === 'finished') return { state: 'finished', request_id: e.data.r };
  return { state: 'failed', request_id: e.data.r, error: e.data.m, category: e.data.c, code: e.data.k as ErrorCode };
}

/**
 * One poll of a client's log, in one round trip: the entries at or before `prevCursor` leave (the
 * client has them), the next ones (at most SESSION_FUTURES_PER_POLL) are read, and the log's
 * lifetime restarts. The cursor answered is the last entry's, or `prevCursor` when there is none.
 */
export async function readSessionFutures(redis: Redis, key: string, prevCursor: number, ttlS: number): Promise<SessionFutures> {
  const res = await redis
    .multi()
    .xtrim(key, 'MINID', `0-${prevCursor + 1}`)
    .xrange(key, `(0-${prevCursor}`, '+', 'COUNT', SESSION_FUTURES_PER_POLL)
    .pexpire(key, ttlS * 1000)
    .exec();
  const failed = res?.find(([err]) => err);
  if (!res || failed) throw failed?.[0] ?? new Error(`retrieve_futures: the read of ${key} was discarded`);
  const entries = (res[1]![1] ?? []) as [string, string[]][];
  const completions: SessionFuture[] = [];
  let cursor = prevCursor;
  for (const [id, fields] of entries) {
    cursor = Number(id.slice(id.indexOf('-') + 1));
    const f = toFuture(fields);
    if (f) completions.push(f);
  }
  return { completions, cursor };
}
