import type { RequestHandler } from 'express';
import { BrokerError } from '../queues/errors.js';

/** `X-API-Key` must be one of the configured keys. `/healthz` is open for health checks. */
export function apiKeyAuth(keys: readonly string[]): RequestHandler {
  const allowed = new Set(keys);
  return (req, _res, next) => {
    if (req.path === '/healthz') return next();
    const key = req.header('x-api-key');
    if (!key) return next(new BrokerError('UNAUTHORIZED', 'missing X-API-Key header'));
    if (!allowed.has(key)) return next(new BrokerError('UNAUTHORIZED', 'invalid API key'));
    next();
  };
}
