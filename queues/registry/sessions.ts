import type { Redis } from 'ioredis';
import type { Names } from '../contract/names.js';
import type { CheckpointRegistry } from './checkpoints.js';
import { RedisRegistry } from './store.js';

/**
 * Client sessions (one per ServiceClient): the record, kept alive by heartbeats; the sets of what it
 * created (training models, sampling sessions; filled by ModelRegistry.index and
 * SamplerRegistry.index); its finish record; and each tenant's listing of its sessions.
 */
export class SessionRegistry extends RedisRegistry {
  constructor(
    redis: Redis,
    names: Names,
    private readonly checkpoints: CheckpointRegistry,
  ) {
    super(redis, names);
  }

  async create(sessionId: string, tenant: string, info: Record<string, unknown>, ttlS: number): Promise<void> {
    await this.redis
      .multi()
      .set(this.names.session(sessionId), JSON.stringify({ session_id: sessionId, created_at: new Date().toISOString(), ...info, tenant }), 'EX', ttlS)
      .zadd(this.names.tenantIndex(tenant, 'sessions'), Date.now(), sessionId)
      .sadd(this.names.tenants(), tenant)
      .exec();
  }
  /** The tenant owning a live session, or null when the session does not exist. */
  async tenantOf(sessionId: string): Promise<string | null> {
    const info = await this.info(sessionId);
    return info === null ? null : typeof info.tenant === 'string' ? info.tenant : '';
  }
  /** A heartbeat: the session and what it lists (its models, samplers and finish record) live another `ttlS`. */
  async touch(sessionId: string, ttlS: number): Promise<boolean> {
    const r = await this.redis
      .multi()
      .expire(this.names.session(sessionId), ttlS)
      .expire(this.names.sessionModels(sessionId), ttlS)
      .expire(this.names.sessionSamplers(sessionId), ttlS)
      .expire(this.names.sessionFinish(sessionId), ttlS)
      .exec();
    return r?.[0]?.[1] === 1;
  }
  async exists(sessionId: string): Promise<boolean> {
    return (await this.redis.exists(this.names.session(sessionId))) === 1;
  }
  async info(sessionId: string): Promise<Record<string, unknown> | null> {
    return (await this.infos([sessionId]))[0] ?? null;
  }
  /** Session records by id (null where gone), in one round trip. */
  async infos(sessionIds: string[]): Promise<(Record<string, unknown> | null)[]> {
    return this.mgetJson(sessionIds.map((id) => this.names.session(id)));
  }
  /** What the session created: its training runs and sampling sessions, sorted. */
  async members(sessionId: string): Promise<{ training_run_ids: string[]; sampler_ids: string[] }> {
    const [models, samplers] = await Promise.all([this.redis.smembers(this.names.sessionModels(sessionId)), this.redis.smembers(this.names.sessionSamplers(sessionId))]);
    return { training_run_ids: models.sort(), sampler_ids: samplers.sort() };
  }
  /** One tenant's sessions, newest first. */
  async list(tenant: string, offset: number, limit: number): Promise<string[]> {
    return this.redis.zrevrange(this.names.tenantIndex(tenant, 'sessions'), offset, offset + limit - 1);
  }
  /** ServiceClient.close(): the first finish record stays, for as long as the session (`ttlS`). */
  async finish(sessionId: string, finish: Record<string, unknown>, ttlS: number): Promise<Record<string, unknown>> {
    const key = this.names.sessionFinish(sessionId);
    await this.redis.set(key, JSON.stringify(finish), 'EX', ttlS, 'NX');
    return JSON.parse((await this.redis.get(key))!);
  }
  async finished(sessionId: string): Promise<boolean> {
    return (await this.redis.exists(this.names.sessionFinish(sessionId))) === 1;
  }
  /** Finish records by session id (null where the session has not finished), in one round trip. */
  async finishes(sessionIds: string[]): Promise<(Record<string, unknown> | null)[]> {
    return this.mgetJson(sessionIds.map((id) => this.names.sessionFinish(id)));
  }
  /** How many listed checkpoints the training runs of each session hold, in three round trips. */
  async checkpointCounts(sessionIds: string[]): Promise<number[]> {
    if (sessionIds.length === 0) return [];
    const p = this.redis.pipeline();
    for (const id of sessionIds) p.smembers(this.names.sessionModels(id));
    const models = ((await p.exec()) ?? []).map(([err, v]) => (err ? [] : (v as string[])));
    const ckpts = await this.checkpoints.ofModels(models.flat());
    let at = 0;
    return models.map((ms) => ms.reduce((n) => n + ckpts[at++]!.length, 0));
  }
  private async mgetJson(keys: string[]): Promise<(Record<string, unknown> | null)[]> {
    if (keys.length === 0) return [];
    return (await this.redis.mget(keys)).map((raw) => (raw === null ? null : JSON.parse(raw)));
  }
}
