import type { ErrorRequestHandler, RequestHandler } from 'express';
import { BrokerError, invalid, isBrokerError } from '../queues/contract/errors.js';
import { logger } from '../queues/infra/logger.js';

/**
 * The one place errors become HTTP. Every error reply has a JSON body in the Tinker error
 * shape `{error, category}` (plus `code`): the SDK retries a 400 with an empty body as a
 * proxy glitch, so a body is never empty.
 */
export const errorHandler: ErrorRequestHandler = (err, req, res, _next) => {
  let be: BrokerError;
  if (isBrokerError(err)) be = err;
  else if (isRedisUnavailable(err)) be = redisUnavailable();
  else if (err?.type === 'entity.parse.failed') be = invalid(`malformed JSON body: ${err.message}`);
  else if (err?.type === 'entity.too.large') be = bodyTooLarge(err.limit);
  else if (typeof err?.status === 'number' && err.status >= 400 && err.status < 500)
    be = invalid(String(err.message ?? 'bad request'));
  else {
    ((res.locals.log as typeof logger | undefined) ?? logger).error('unhandled error', { path: req.path, error: String(err?.stack ?? err) });
    be = new BrokerError('INTERNAL', `internal error: ${String(err?.message ?? err)}`);
  }
  if (be.code === 'OVERLOADED') res.setHeader('Retry-After', '1');
  if (be.code === 'UNAVAILABLE') res.setHeader('Retry-After', String(REDIS_RETRY_AFTER_S));
  res.status(be.status).json({ error: be.message, category: be.category, code: be.code });
};

export const notFoundHandler: RequestHandler = (req, _res, next) => {
  next(new BrokerError('NOT_FOUND', `no such endpoint: ${req.method} ${req.path}`));
};

/** Seconds a client is asked to wait while Redis is unreachable. */
export const REDIS_RETRY_AFTER_S = 2;

export function redisUnavailable(): BrokerError {
  return new BrokerError('UNAVAILABLE', 'the broker cannot reach Redis right now; retry shortly');
}

/**
 * Errors of an unreachable Redis, as ioredis and BullMQ raise them: a command that gave up after
 * its reconnect attempts, a closed connection, a refused or reset socket.
 */
export function isRedisUnavailable(err: unknown): boolean {
  if (!(err instanceof Error)) return false;
  if (err.name === 'MaxRetriesPerRequestError') return true;
  const code = (err as { code?: unknown }).code;
  if (typeof code === 'string' && ['ECONNREFUSED', 'ECONNRESET', 'ETIMEDOUT', 'EPIPE', 'ENOTCONN', 'EHOSTUNREACH'].includes(code)) return true;
  return /Connection is closed|Stream isn't writeable|max retries per request|ECONNREFUSED|Socket closed unexpectedly/i.test(err.message);
}

/** A body past its route's limit (express's body parsers, and the forward_backward body reader). */
export function bodyTooLarge(limitBytes: number): BrokerError {
  return invalid(`request body too large (limit ${limitBytes} bytes)`);
}
