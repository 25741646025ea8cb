import type { Redis } from 'ioredis';
import type { Names } from '../contract/names.js';

/**
 * The listing sweep (every API process runs it, api/app.ts): drops the entries whose record is gone
 * (expired) from the tenants' session and model listings, from the model and sampler sets of live
 * sessions, and from the models' last-request times. Walks every listing in chunks (ZSCAN/SSCAN,
 * one pipelined EXISTS per chunk); returns how many entries it dropped. Checkpoint listings need no
 * sweep: their entries leave with the checkpoint's record (queues/registry/checkpoints.ts).
 */
export async function pruneListings(redis: Redis, names: Names, chunk = 500): Promise<number> {
  let dropped = 0;
  // Members of `key` (a sorted set or a set) whose record (`recordKey`) is gone; `gone` removes them.
  const sweep = async (key: string, sorted: boolean, recordKey: (id: string) => string, gone: (ids: string[]) => Promise<unknown>, live?: (ids: string[]) => Promise<void>) => {
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
      if (live) await live(ids.filter((_, i) => exists[i]));
    } while (cursor !== '0');
  };
  for (const tenant of await redis.smembers(names.tenants())) {
    await sweep(
      names.tenantIndex(tenant, 'sessions'),
      true,
      (id) => names.session(id),
      (ids) => redis.zrem(names.tenantIndex(tenant, 'sessions'), ...ids),
      async (sessions) => {
        // The model and sampler sets of a chunk of live sessions, in three round trips.
        const sets = sessions.flatMap((s) => [
          { key: names.sessionModels(s), record: (id: string) => names.model(id) },
          { key: names.sessionSamplers(s), record: (id: string) => names.samplingSession(id) },
        ]);
        const members = await pipelined(redis, sets.map((x) => ['smembers', x.key]));
        const entries = sets.flatMap((x, i) => ((members[i] as string[] | null) ?? []).map((id) => ({ key: x.key, id, record: x.record(id) })));
        const exists = await pipelined(redis, entries.map((e) => ['exists', e.record]));
        const missing = entries.filter((_, i) => exists[i] === 0);
        if (missing.length) await pipelined(redis, missing.map((e) => ['srem', e.key, e.id]));
        dropped += missing.length;
      },
    );
    await sweep(
      names.tenantIndex(tenant, 'models'),
      true,
      (id) => names.model(id),
      (ids) => redis.multi().zrem(names.tenantIndex(tenant, 'models'), ...ids).hdel(names.modelLast(), ...ids).exec(),
    );
  }
  return dropped;
}

/** Commands in one pipeline; each one's reply (null where it failed). */
async function pipelined(redis: Redis, cmds: string[][]): Promise<unknown[]> {
  if (cmds.length === 0) return [];
  return ((await redis.pipeline(cmds).exec()) ?? []).map(([err, v]) => (err ? null : v));
}
