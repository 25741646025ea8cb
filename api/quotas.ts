import type { Request } from 'express';
import { BrokerError } from '../queues/contract/errors.js';
import type { TenantListing } from '../queues/contract/names.js';
import { loadApiConfig, type TenantMax } from '../queues/infra/config.js';
import { pruneTenantListing } from '../queues/registry/listings.js';
import { tenantOf } from './auth.js';
import type { ApiContext } from './context.js';

/**
 * Tenant quotas: how many sessions, training models, sampling sessions and checkpoints one API key
 * holds at once (TB_TENANT_MAX_*). Each stored field is bounded too (api/http-schemas.ts), so a
 * tenant's footprint in Redis is bounded. A create past the limit answers 403 QUOTA_EXCEEDED,
 * which the SDK does not retry.
 *
 * The count is the tenant's listing in Redis. Before it refuses, the API drops the entries whose
 * record has expired, so an expired record never holds room. Requests that race may pass the limit
 * by as many as are in flight at once; the bound holds within that.
 */

const WHAT: Record<TenantListing, { label: string; env: string; free: string }> = {
  sessions: { label: 'sessions', env: 'TB_TENANT_MAX_SESSIONS', free: 'sessions expire one retention period after their last heartbeat' },
  models: { label: 'training models', env: 'TB_TENANT_MAX_MODELS', free: 'unloaded and idle models expire after the retention period' },
  samplers: { label: 'sampling sessions', env: 'TB_TENANT_MAX_SAMPLING_SESSIONS', free: 'sampling sessions expire one retention period after their last use' },
  ckpts: { label: 'checkpoints', env: 'TB_TENANT_MAX_CHECKPOINTS', free: 'delete checkpoints you no longer need, or give them a TTL' },
};

let defaults: TenantMax | undefined;

/** The limits in force: the configured ones, else the environment schema's defaults. */
export function tenantMax(ctx: ApiContext): TenantMax {
  defaults ??= loadApiConfig({}).tenantMax as TenantMax;
  return { ...defaults, ...ctx.config.tenantMax };
}

/**
 * Refuses with QUOTA_EXCEEDED when the caller already holds the most records of this kind, unless
 * `already` says the request's record exists (a retried create, a save over a named checkpoint).
 */
export async function ensureRoom(ctx: ApiContext, req: Request, what: TenantListing, already?: () => Promise<boolean>): Promise<void> {
  const tenant = tenantOf(req);
  const max = tenantMax(ctx)[what];
  const key = ctx.names.tenantIndex(tenant, what);
  if ((await ctx.redis.zcard(key)) < max) return;
  await pruneTenantListing(ctx.redis, ctx.names, tenant, what);
  const held = await ctx.redis.zcard(key);
  if (held < max || (already && (await already()))) return;
  const w = WHAT[what];
  throw new BrokerError('QUOTA_EXCEEDED', `this API key holds ${held} ${w.label}, its limit (${w.env}=${max}); ${w.free}`);
}
