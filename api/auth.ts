import { createHash, timingSafeEqual } from 'node:crypto';
import type { Request, RequestHandler } from 'express';
import { BrokerError } from '../queues/contract/errors.js';

/**
 * Authentication: every API key is a tenant. A tenant's id is derived from its key (a digest, so
 * the key itself is never stored in Redis); every session, model, sampler, checkpoint and future
 * records the tenant that made it (see tenants.ts).
 */

/** The well-known default key of a local install; refused on a public interface (assertSafeKeys). */
export const DEFAULT_API_KEY = 'tml-local';

const LOOPBACK = new Set(['127.0.0.1', '::1', 'localhost', '::ffff:127.0.0.1']);

/**
 * The API refuses to listen beyond loopback with the well-known default key unless the operator
 * chose the keys (TB_API_KEYS): anyone who can reach the port would otherwise be a tenant.
 */
export class StartRefused extends Error {
  override readonly name = 'StartRefused';
}

export function assertSafeKeys(config: { host: string; apiKeys: readonly string[] }, env: NodeJS.ProcessEnv): void {
  const loopback = LOOPBACK.has(config.host) || /^127\./.test(config.host);
  if (!loopback && config.apiKeys.includes(DEFAULT_API_KEY) && !env.TB_API_KEYS)
    throw new StartRefused(
      `refusing to listen on ${config.host} with the well-known default API key '${DEFAULT_API_KEY}': set TB_API_KEYS to your own keys (comma separated), or listen on 127.0.0.1`,
    );
}

const digest = (s: string) => createHash('sha256').update(s, 'utf8').digest();

/** The tenant id of an API key: stable across API processes and restarts. */
export function tenantId(key: string): string {
  return `k${digest(key).toString('hex').slice(0, 24)}`;
}

type TenantRequest = Request & { tenant?: string };

/** The tenant of an authenticated request. */
export function tenantOf(req: Request): string {
  const t = (req as TenantRequest).tenant;
  if (!t) throw new BrokerError('UNAUTHORIZED', 'missing X-API-Key header');
  return t;
}

/**
 * `X-API-Key` must be one of the configured keys, compared in constant time (digests of equal
 * length, every configured key compared). `/healthz` is open for health checks.
 */
export function apiKeyAuth(keys: readonly string[]): RequestHandler {
  const allowed = keys.map((k) => ({ d: digest(k), tenant: tenantId(k) }));
  return (req, _res, next) => {
    if (req.path === '/healthz') return next();
    const key = req.header('x-api-key');
    if (!key) return next(new BrokerError('UNAUTHORIZED', 'missing X-API-Key header'));
    const d = digest(key);
    let tenant: string | null = null;
    for (const a of allowed) if (timingSafeEqual(a.d, d)) tenant = a.tenant;
    if (tenant === null) return next(new BrokerError('UNAUTHORIZED', 'invalid API key'));
    (req as TenantRequest).tenant = tenant;
    next();
  };
}
