import { z } from 'zod';
import { RecentReads } from '../infra/recent.js';
import { RedisRegistry } from './store.js';

/** How old a read of a sampling session SamplerRegistry.recent may reuse. */
export const SESSION_REUSE_MS = 100;

/**
 * Sampling sessions (pinned to a base model, to one sampler version, or to a training model's
 * inflight target) and each training model's inflight target. Sampler versions themselves are
 * checkpoint records (queues/registry/checkpoints.ts, `sampler_weights/<name>`).
 */

export const SamplingSessionRecord = z.object({
  sampling_session_id: z.string(),
  session_id: z.string(),
  base_model: z.string(),
  model_path: z.string().nullable(),
  adapter_dir: z.string().nullable(),
  /** An inflight session samples its model's current inflight target (SamplerRegistry.inflightTarget). */
  inflight_model_id: z.string().nullish(),
  /** The owning tenant, as for models. */
  tenant: z.string().default(''),
});
export type SamplingSessionRecord = z.infer<typeof SamplingSessionRecord>;

export const InflightTarget = z.object({ model_path: z.string(), adapter_dir: z.string(), seq_id: z.number().int() });
export type InflightTarget = z.infer<typeof InflightTarget>;

export class SamplerRegistry extends RedisRegistry {
  /**
   * Stores the record (for `ttlS`) unless one exists, and lists it under its tenant (for the quota;
   * the listing sweep drops it once the record expires); returns the stored one (a retried create
   * names the same session).
   */
  async put(rec: SamplingSessionRecord, ttlS: number): Promise<SamplingSessionRecord> {
    const stored = await this.putJsonIfAbsent(this.names.samplingSession(rec.sampling_session_id), rec, ttlS, SamplingSessionRecord);
    if (stored.tenant) await this.redis.multi().zadd(this.names.tenantIndex(stored.tenant, 'samplers'), 'NX', Date.now(), stored.sampling_session_id).sadd(this.names.tenants(), stored.tenant).exec();
    return stored;
  }
  async get(id: string): Promise<SamplingSessionRecord | null> {
    return this.getJson(this.names.samplingSession(id), SamplingSessionRecord);
  }
  /** Found records of `recent`, reused: each sample request of a burst names its session. */
  private readonly found = new RecentReads<SamplingSessionRecord | null>(SESSION_REUSE_MS, 4096);
  /**
   * get, reusing a read at most SESSION_REUSE_MS old that found the record (a record never changes
   * once written; it only expires, which a caller then sees that much later). A read that found
   * nothing is not reused: a session created meanwhile is found at once.
   */
  async recent(id: string): Promise<SamplingSessionRecord | null> {
    return this.found.get(id, () => this.get(id), (r) => r !== null);
  }
  /** A sample request through the session: it lives another `ttlS`. */
  async touch(id: string, ttlS: number): Promise<void> {
    await this.redis.expire(this.names.samplingSession(id), ttlS);
  }
  /** Lists a sampling session under the session that created it (whose set lives `ttlS`, as the session does). */
  async index(sessionId: string, samplerId: string, ttlS: number): Promise<void> {
    const set = this.names.sessionSamplers(sessionId);
    await this.redis.multi().sadd(set, samplerId).expire(set, ttlS).exec();
  }
  /** The model's inflight sampler target: its newest `kind: inflight` save (saves of a model run in order). */
  async setInflightTarget(modelId: string, target: InflightTarget, ttlS: number): Promise<void> {
    await this.redis.set(this.names.inflight(modelId), JSON.stringify(target), 'EX', ttlS);
  }
  async inflightTarget(modelId: string): Promise<InflightTarget | null> {
    return this.getJson(this.names.inflight(modelId), InflightTarget);
  }
}
