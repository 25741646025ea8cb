/**
 * The closed set of errors the broker raises, shared by the API, the agents and the engines
 * (an engine's error reply maps onto a code with `engineFailure`). `api/errors.ts` is the one
 * place that maps them to HTTP. A failure crosses the queue with its code: a failed job's reason
 * is `[CODE] message` (`encodeJobFailure` / `decodeJobFailure`), a failed outcome or failed-future
 * record stores `code` beside `category` (`recordedFailure` reads both, old records included), and
 * `retrieve_future` answers `{error, category, code}`.
 */
export type ErrorCategory = 'user' | 'server' | 'unknown';

export const ERROR_CODES = {
  /** The request (or a job built from it) is malformed or breaks a rule; the engine refused its input. */
  INVALID_REQUEST: { status: 400, category: 'user' },
  UNAUTHORIZED: { status: 401, category: 'user' },
  /** The session, model, sampling session, checkpoint, future or endpoint does not exist (or is another tenant's). */
  NOT_FOUND: { status: 404, category: 'user' },
  /** A sampling session's pinned sampler version no longer exists (deleted or expired). */
  STALE_SAMPLER: { status: 400, category: 'user' },
  CONFLICT: { status: 409, category: 'user' },
  /** The session has finished (ServiceClient.close): its heartbeats stop. */
  GONE: { status: 410, category: 'user' },
  /**
   * The tenant holds as many sessions, models, sampling sessions or checkpoints as it may
   * (TB_TENANT_MAX_*). Not retried by the SDK: room comes back when records expire or are deleted.
   */
  QUOTA_EXCEEDED: { status: 403, category: 'user' },
  /** A bound was reached (queued samples); retry after `Retry-After`. */
  OVERLOADED: { status: 429, category: 'server' },
  /**
   * What the op needs cannot be reached: Redis (HTTP 503 with `Retry-After`), or the model, whose
   * weights were lost with its agent or engine (its futures fail; load it from a checkpoint).
   */
  UNAVAILABLE: { status: 503, category: 'server' },
  /** The engine failed while running the op (its error reply, a dead engine, an invalid result). */
  ENGINE_FAILED: { status: 500, category: 'server' },
  /** A bug or an unexpected failure of the broker itself. */
  INTERNAL: { status: 500, category: 'server' },
  /**
   * A training op whose effect nobody can know (its agent died or hung, its job lock was lost with
   * its outcome unrecorded): the model's state is undefined. Never retry the op; reload the model
   * from a checkpoint. Futures carry it as category `unknown` and code `OUTCOME_UNKNOWN`.
   */
  OUTCOME_UNKNOWN: { status: 500, category: 'unknown' },
} as const satisfies Record<string, { status: number; category: ErrorCategory }>;

export type ErrorCode = keyof typeof ERROR_CODES;

function isErrorCode(s: unknown): s is ErrorCode {
  return typeof s === 'string' && Object.hasOwn(ERROR_CODES, s);
}

export class BrokerError extends Error {
  override readonly name: string = 'BrokerError';
  readonly code: ErrorCode;
  constructor(code: ErrorCode, message: string, options?: { cause?: unknown }) {
    super(message, options);
    this.code = code;
  }
  get category(): ErrorCategory {
    return ERROR_CODES[this.code].category;
  }
  get status(): number {
    return ERROR_CODES[this.code].status;
  }
}

/** Errors cross module copies in tests; match by name as well as by class. */
export function isBrokerError(err: unknown): err is BrokerError {
  return err instanceof BrokerError || (err instanceof Error && isErrorCode((err as { code?: unknown }).code) && 'category' in err);
}

/** The INVALID_REQUEST error every request check raises. */
export const invalid = (message: string): BrokerError => new BrokerError('INVALID_REQUEST', message);

/** The code of an engine's error reply: its input refused (`user`) or the engine failed (`server`). */
export function engineCode(category: ErrorCategory): ErrorCode {
  return category === 'user' ? 'INVALID_REQUEST' : category === 'unknown' ? 'OUTCOME_UNKNOWN' : 'ENGINE_FAILED';
}

/** A failure as a future reports it. */
export type Failure = { code: ErrorCode; category: ErrorCategory; message: string };

export function failure(code: ErrorCode, message: string): Failure {
  return { code, category: ERROR_CODES[code].category, message };
}

/** Any error as a failure: a BrokerError keeps its code; anything else is `fallback` (INTERNAL unless told). */
export function failureOf(err: unknown, fallback: ErrorCode = 'INTERNAL'): Failure {
  if (isBrokerError(err)) return failure(err.code, err.message);
  return failure(fallback, String((err as Error)?.message ?? err));
}

/**
 * A failure read from a record that stores `category` and maybe `code` (outcomes, failed futures,
 * the gate's records): records without a code (older ones, the gate's) get their category's.
 */
export function recordedFailure(r: { category?: ErrorCategory | undefined; code?: string | undefined; message?: string | undefined }): Failure {
  const code = isErrorCode(r.code) ? r.code : engineCode(r.category ?? 'server');
  return { code, category: r.category ?? ERROR_CODES[code].category, message: r.message ?? 'failed' };
}

/**
 * A job's failure reason as stored by BullMQ (`job.failedReason`): `[CODE] message`, the agent's
 * verdict. Reasons without it (a stall, a crash) carry no verdict.
 */
export function encodeJobFailure(f: { code: ErrorCode; message: string }): string {
  return `[${f.code}] ${f.message}`;
}

/** The failure a job's reason reports; `verdict` is false when no agent gave one (a stall, a crash: a server error). */
export function decodeJobFailure(reason: string | undefined): Failure & { verdict: boolean } {
  const text = reason ?? 'the job failed without a reason';
  const m = /^\[([A-Za-z_]+)\] ([\s\S]*)$/.exec(text);
  if (m && isErrorCode(m[1])) return { ...failure(m[1], m[2] ?? ''), verdict: true };
  // Reasons written before codes crossed the queue: `[user|server|unknown] message`.
  if (m && (m[1] === 'user' || m[1] === 'server' || m[1] === 'unknown')) return { ...recordedFailure({ category: m[1], message: m[2] }), verdict: true };
  return { ...failure('INTERNAL', text), verdict: false };
}

/**
 * The message of an OUTCOME_UNKNOWN failure: what happened, and what the client must do instead
 * of retrying. docs/reliability.md documents it.
 */
export function outcomeUnknownMessage(op: string, why: string): string {
  return (
    `OUTCOME_UNKNOWN: the outcome of this ${op} is unknown (${why}); it may or may not have been applied, ` +
    `so the model's state is undefined. Do not retry it: load the model from a saved checkpoint and continue from there`
  );
}

/** Why an op of a model whose weights are gone (its agent or engine ended, it was unloaded) fails. */
export function modelUnavailable(modelId: string, why: string): string {
  return `model ${modelId} is unavailable: ${why}`;
}
