/**
 * The closed set of errors the broker raises, shared by the API and the agents.
 * `api/errors.ts` is the one place that maps them to HTTP; a failed job carries
 * `category` and message through `encodeJobFailure` / `decodeJobFailure`.
 */
export type ErrorCategory = 'user' | 'server' | 'unknown';

export const ERROR_CODES = {
  INVALID_REQUEST: { status: 400, category: 'user' },
  UNAUTHORIZED: { status: 401, category: 'user' },
  NOT_FOUND: { status: 404, category: 'user' },
  STALE_SAMPLER: { status: 400, category: 'user' },
  CONFLICT: { status: 409, category: 'user' },
  GONE: { status: 410, category: 'user' },
  OVERLOADED: { status: 429, category: 'server' },
  UNAVAILABLE: { status: 503, category: 'server' },
  ENGINE_FAILED: { status: 500, category: 'server' },
  INTERNAL: { status: 500, category: 'server' },
  /**
   * A training op whose effect nobody can know (its agent died or hung, its job lock was lost with
   * its outcome unrecorded): the model's state is undefined. Never retry the op; reload the model
   * from a checkpoint. Futures carry it as category `unknown` and code `OUTCOME_UNKNOWN`.
   */
  OUTCOME_UNKNOWN: { status: 500, category: 'unknown' },
} as const satisfies Record<string, { status: number; category: ErrorCategory }>;

export type ErrorCode = keyof typeof ERROR_CODES;

export class BrokerError extends Error {
  override readonly name = 'BrokerError';
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
  return err instanceof BrokerError || (err instanceof Error && err.name === 'BrokerError' && 'code' in err);
}

/**
 * A job's failure reason as stored by BullMQ (`job.failedReason`): `[user] message` or
 * `[server] message`. Anything without the prefix (a stall, a crash) counts as a server error.
 */
export function encodeJobFailure(category: ErrorCategory, message: string): string {
  return `[${category}] ${message}`;
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

export function decodeJobFailure(reason: string | undefined): { category: ErrorCategory; message: string } {
  const text = reason ?? 'the job failed without a reason';
  const m = /^\[(user|server|unknown)\] ([\s\S]*)$/.exec(text);
  if (m) return { category: m[1] as ErrorCategory, message: m[2] ?? '' };
  return { category: 'server', message: text };
}
