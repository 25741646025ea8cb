import { z } from 'zod';
import { LoraConfig } from '../contract/schemas.js';
import { RedisRegistry } from './store.js';

/**
 * Training models (training runs): where each is placed, its LoRA config and vocabulary, and
 * `lost_reason` once its weights are gone; their lifetimes (queues/contract/names.ts `model`) and their
 * listings (per tenant, per session, and each model's last request).
 */

export const ModelRecord = z.object({
  model_id: z.string(),
  session_id: z.string(),
  base_model: z.string(),
  arch: z.string(),
  vocab_size: z.number().int(),
  lora: LoraConfig,
  agent_id: z.string(),
  train_queue: z.string(),
  created_at: z.string(),
  /** Set when the model's weights were lost (engine restart); training on it then fails. */
  lost_reason: z.string().nullable().default(null),
  /** The tenant (API key) that owns the model; `''` (records older than tenants) belongs to none. */
  tenant: z.string().default(''),
  /** The base model's context length when the model was placed; null for records older than this field. */
  max_context_length: z.number().int().nullable().default(null),
  /**
   * Set (ISO time) when the model's agent died and it waits for a live agent serving its base to
   * adopt it from its snapshot (workers/agent/adoption.ts); null while it is placed.
   */
  orphaned_at: z.string().nullable().default(null),
});
export type ModelRecord = z.infer<typeof ModelRecord>;

/** How long a process uses its copy of a model's record for training ops (ModelRegistry.placed), and how many it keeps. */
const PLACED_CACHE_MS = 30_000;
const PLACED_CACHE_MAX = 10_000;

export class ModelRegistry extends RedisRegistry {
  /** Stores the record (for `ttlS`) unless one exists; returns the stored one (create_model is idempotent). */
  async putIfAbsent(rec: ModelRecord, ttlS: number): Promise<ModelRecord> {
    return this.putJsonIfAbsent(this.names.model(rec.model_id), rec, ttlS, ModelRecord);
  }
  async get(modelId: string): Promise<ModelRecord | null> {
    return this.getJson(this.names.model(modelId), ModelRecord);
  }

  /**
   * The model's record for building a training op's job, from a copy this process read within
   * PLACED_CACHE_MS when it has one (else read, and kept). A model's owner, base model, vocabulary
   * and LoRA config never change; its `lost_reason`, its placement (an adoption moves it) and its
   * very existence do, so a caller of this copy submits with the gate's `checkModel`
   * (queues/runtime/gate.ts), which checks all three in the submit's script, and `forget`s the copy when that refuses.
   */
  async placed(modelId: string): Promise<ModelRecord | null> {
    const now = Date.now();
    const hit = this.placedCache.get(modelId);
    if (hit && now - hit.at < PLACED_CACHE_MS) return hit.rec;
    const rec = await this.get(modelId);
    this.placedCache.delete(modelId);
    if (rec && rec.lost_reason === null) {
      if (this.placedCache.size >= PLACED_CACHE_MAX) this.placedCache.delete(this.placedCache.keys().next().value!);
      this.placedCache.set(modelId, { rec, at: now });
    }
    return rec;
  }
  /** Drops this process's copy of the model's record (ModelRegistry.placed). */
  forget(modelId: string): void {
    this.placedCache.delete(modelId);
  }
  private readonly placedCache = new Map<string, { rec: ModelRecord; at: number }>();
  async markLost(modelId: string, reason: string): Promise<void> {
    const m = await this.get(modelId);
    if (m && m.lost_reason === null) await this.redis.set(this.names.model(modelId), JSON.stringify({ ...m, lost_reason: reason }), 'KEEPTTL', 'XX');
  }
  /** Marks every model placed on `agentId` lost (but those in `except`); returns the ids it marked. */
  async markLostOnAgent(agentId: string, reason: string, except: ReadonlySet<string> = new Set()): Promise<string[]> {
    const lost: string[] = [];
    for (const m of await this.onAgent(agentId)) {
      if (except.has(m.model_id)) continue;
      await this.redis.set(this.names.model(m.model_id), JSON.stringify({ ...m, lost_reason: reason }), 'KEEPTTL', 'XX');
      lost.push(m.model_id);
    }
    return lost;
  }
  /**
   * Marks every model placed on the dead `agentId` (not lost) as waiting for adoption, and lists it
   * among the orphans; returns them as they were.
   */
  async orphanOnAgent(agentId: string): Promise<ModelRecord[]> {
    const now = new Date();
    const out = await this.onAgent(agentId);
    for (const m of out) {
      await this.redis.set(this.names.model(m.model_id), JSON.stringify({ ...m, orphaned_at: now.toISOString() }), 'KEEPTTL', 'XX');
      await this.redis.zadd(this.names.orphans(), now.getTime(), m.model_id);
    }
    return out;
  }
  /** The models waiting for adoption (oldest first, at most `limit`). */
  async orphans(limit = 100): Promise<string[]> {
    return this.redis.zrange(this.names.orphans(), 0, limit - 1);
  }
  /** The models placed on the agent that are not lost nor waiting for adoption (a scan of the model records). */
  async onAgent(agentId: string): Promise<ModelRecord[]> {
    const out: ModelRecord[] = [];
    let cursor = '0';
    do {
      const [next, keys] = await this.redis.scan(cursor, 'MATCH', this.names.model('*'), 'COUNT', 200);
      cursor = next;
      for (const key of keys) {
        const raw = await this.redis.get(key);
        if (!raw) continue;
        const m = ModelRecord.parse(JSON.parse(raw));
        if (m.agent_id === agentId && m.lost_reason === null && m.orphaned_at === null) out.push(m);
      }
    } while (cursor !== '0');
    return out;
  }
  /**
   * The models stay at least `ttlS` more (never less than they had; a model kept without a TTL
   * stays so): what an agent's heartbeat does for the models loaded on it, so a model in use never
   * expires. The record and the gate's next seq_id share one lifetime.
   */
  async keep(modelIds: Iterable<string>, ttlS: number): Promise<void> {
    const p = this.redis.pipeline();
    for (const id of modelIds) p.expire(this.names.model(id), ttlS, 'GT').expire(this.names.gateNext(id), ttlS, 'GT');
    if (p.length) await p.exec();
  }

  // ---- listings ----
  /** Lists a model under its tenant and its session (whose set lives `ttlS`, as the session does). */
  async index(rec: ModelRecord, ttlS: number): Promise<void> {
    const set = this.names.sessionModels(rec.session_id);
    await this.redis
      .multi()
      .zadd(this.names.tenantIndex(rec.tenant, 'models'), Date.parse(rec.created_at), rec.model_id)
      .sadd(this.names.tenants(), rec.tenant)
      .sadd(set, rec.model_id)
      .expire(set, ttlS)
      .exec();
  }
  /** Records a request to the model now (the gate's submit script records each training op's itself). */
  async touch(modelId: string): Promise<void> {
    await this.redis.hset(this.names.modelLast(), modelId, new Date().toISOString());
  }
  /** Each model's last training request (ISO time), null where none is recorded. */
  async lastRequests(modelIds: string[]): Promise<(string | null)[]> {
    if (modelIds.length === 0) return [];
    return this.redis.hmget(this.names.modelLast(), ...modelIds);
  }
  /** One tenant's models (training runs), newest first, one page. */
  async list(tenant: string, offset: number, limit: number): Promise<{ models: ModelRecord[]; total: number }> {
    const key = this.names.tenantIndex(tenant, 'models');
    const [ids, total] = await Promise.all([this.redis.zrevrange(key, offset, offset + limit - 1), this.redis.zcard(key)]);
    const raws = ids.length ? await this.redis.mget(ids.map((id) => this.names.model(id))) : [];
    const models = raws.flatMap((raw) => (raw === null ? [] : [ModelRecord.parse(JSON.parse(raw))]));
    return { models, total };
  }
}
