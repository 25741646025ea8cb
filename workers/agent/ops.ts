import { ZodError } from 'zod';
import { failure, failureOf, type Failure } from '../../queues/contract/errors.js';
import type { TokenKind } from '../../queues/runtime/metrics.js';
import type { AnyJob } from '../../queues/contract/schemas.js';

/** What the training pipeline and the sample workers share: how a failed op reports, and what a finished one counts. */

/** What a failed op reports: a broker (or engine) error's code, else INTERNAL. */
export function opFailure(op: string, err: unknown): Failure {
  if (err instanceof ZodError) return failure('INTERNAL', `invalid ${op} job payload: ${err.issues.map((i) => `${i.path.join('.')}: ${i.message}`).join('; ')}`);
  return failureOf(err);
}

/** Sampled tokens (generated sequences) and trained tokens (forward_backward inputs, not forward-only) of a job that succeeded. */
export function tokensOf(d: AnyJob, result: unknown): { kind: TokenKind; n: number } | undefined {
  if (d.op === 'forward_backward' && !d.forward_only) return { kind: 'trained', n: d.data.reduce((s, x) => s + x.tokens.length, 0) };
  const seqs = (result as { sequences?: { tokens: unknown[] }[] } | null)?.sequences;
  if (d.op === 'sample' && Array.isArray(seqs)) return { kind: 'sampled', n: seqs.reduce((s, x) => s + x.tokens.length, 0) };
  return undefined;
}
