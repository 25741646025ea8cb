import type { Redis } from 'ioredis';
import type { Names, TenantListing } from '../contract/names.js';

/**
 * The listing sweep (every API process runs it, api/app.ts): drops the entries whose record is gone
 * (expired) from the tenants' session, model and sampling-session listings, from the model and
 * sampler sets of live sessions, and from the models' last-request times. Returns how many entries
 * it dropped. Checkpoint listings need no sweep: their entries leave with the checkpoint's record
 * (queues/registry/checkpoints.ts).
 */
/**
 * Drops the members of `key` (a sorted set or a set) whose record (`recordKey`) is gone, in chunks
 * (ZSCAN/SSCAN, one pipelined EXISTS per chunk); `gone` removes them, `live` sees the others.
 * Returns how many it dropped.
 */
async function sweep(
  redis: Redis,
  key: string,
  sorted: boolean,
  recordKey: (id: string) => string,
  gone: (ids: string[]) => Promise<unknown>,
  chunk: number,
  live?: (ids: string[]) => Promise<number>,
): Promise<number> {
  let dropped = 0;
  let cursor = '0';
  do {
    const [next, flat] = sorted ? await redis.zscan(key, cursor, 'COUNT', chunk) : await redis.sscan(key, cursor, 'COUNT', chunk);
    cursor = next;
    const ids = sorted ? flat.filter((_, i) => i % 2 === 0) : flat;
    if (ids.length === 0) continue;
    const p = redis.pipeline();
    for (const id of ids) p.exists(recordKey(id));
    const exists = ((await p.exec()) ?? []).map(([err, v]) => err !== null || v === 1);
    const missing = ids.filter((_, i) => !exists[i]);
    if (missing.length) {
      await gone(missing);
      dropped += missing.length;
    }
    if (live) dropped += await live(ids.filter((_, i) => exists[i]));
  } while (cursor !== '0');
  return dropped;
}

/** The record behind each entry of a tenant's listing. */
function listingRecord(names: Names, what: TenantListing): (id: string) => string {
  if (what === 'sessions') return (id) => names.session(id);
  if (what === 'models') return (id) => names.model(id);
  if (what === 'samplers') return (id) => names.samplingSession(id);
  return (path) => names.checkpoint(path);
}

/**
 * Drops the entries of one tenant listing whose record is gone (a model's last-request time
 * with it); returns how many. The quotas (api/quotas.ts) call it before they refuse.
 */
export async function pruneTenantListing(redis: Redis, names: Names, tenant: string, what: TenantListing, chunk = 500): Promise<number> {
  const key = names.tenantIndex(tenant, what);
  const gone = what === 'models' ? (ids: string[]) => redis.multi().zrem(key, ...ids).hdel(names.modelLast(), ...ids).exec() : (ids: string[]) => redis.zrem(key, ...ids);
  return sweep(redis, key, true, listingRecord(names, what), gone, chunk);
}

export async function pruneListings(redis: Redis, names: Names, chunk = 500): Promise<number> {
  let dropped = 0;
  for (const tenant of await redis.smembers(names.tenants())) {
    const sessions = names.tenantIndex(tenant, 'sessions');
    dropped += await sweep(redis, sessions, true, (id) => names.session(id), (ids) => redis.zrem(sessions, ...ids), chunk, async (live) => {
      // The model and sampler sets of a chunk of live sessions, in three round trips.
      const sets = live.flatMap((s) => [
        { key: names.sessionModels(s), record: (id: string) => names.model(id) },
        { key: names.sessionSamplers(s), record: (id: string) => names.samplingSession(id) },
      ]);
      const members = await pipelined(redis, sets.map((x) => ['smembers', x.key]));
      const entries = sets.flatMap((x, i) => ((members[i] as string[] | null) ?? []).map((id) => ({ key: x.key, id, record: x.record(id) })));
      const exists = await pipelined(redis, entries.map((e) => ['exists', e.record]));
      const missing = entries.filter((_, i) => exists[i] === 0);
      if (missing.length) await pipelined(redis, missing.map((e) => ['srem', e.key, e.id]));
      return missing.length;
    });
    dropped += await pruneTenantListing(redis, names, tenant, 'models', chunk);
    dropped += await pruneTenantListing(redis, names, tenant, 'samplers', chunk);
  }
  return dropped;
}

/** Commands in one pipeline; each one's reply (null where it failed). */
async function pipelined(redis: Redis, cmds: string[][]): Promise<unknown[]> {
  if (cmds.length === 0) return [];
  return ((await redis.pipeline(cmds).exec()) ?? []).map(([err, v]) => (err ? null : v));
}
