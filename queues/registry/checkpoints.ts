import { z } from 'zod';
import { LoraConfig } from '../contract/schemas.js';
import { RedisRegistry } from './store.js';

/**
 * Checkpoint records: one per saved checkpoint, listed under its model and (when named) its tenant,
 * and by expiry when it has a TTL. A named checkpoint keeps its model's record without a TTL while it
 * exists. The rules of saving over one and loading from one are in queues/runtime/checkpoints.ts; the files,
 * the sweep of expired ones and the REST calls in api/services/checkpoints.ts.
 */

/**
 * A saved checkpoint: training state (`weights/<name>`: adapter + optimizer) or a sampler
 * version (`sampler_weights/<name>`: an immutable PEFT adapter). Files live in `dir`.
 */
export const CheckpointRecord = z.object({
  tinker_path: z.string(),
  model_id: z.string(),
  /** `weights/<name>`, `sampler_weights/<name>` or `external_weights/<name>`, as the SDK's REST calls name it. */
  checkpoint_id: z.string(),
  checkpoint_type: z.enum(['training', 'sampler', 'external']),
  base_model: z.string(),
  lora: LoraConfig,
  dir: z.string(),
  time: z.string(),
  size_bytes: z.number().int().nullable(),
  expires_at: z.string().nullable(),
  public: z.boolean(),
  has_optimizer: z.boolean(),
  /** The unnamed saves behind save_weights_and_get_sampling_client: not listed, expire with the retention. */
  ephemeral: z.boolean(),
  user_metadata: z.record(z.string(), z.string()).nullable(),
  /** The owning tenant (the tenant of `model_id`). Other tenants read it only while `public`. */
  tenant: z.string().default(''),
});
export type CheckpointRecord = z.infer<typeof CheckpointRecord>;

export class CheckpointRegistry extends RedisRegistry {
  /** Stores a checkpoint's record; a listed (named) one keeps its model's record without a TTL while it exists. */
  async put(rec: CheckpointRecord): Promise<void> {
    const m = this.redis
      .multi()
      .set(this.names.checkpoint(rec.tinker_path), JSON.stringify(rec))
      .zadd(this.names.modelCheckpoints(rec.model_id), Date.parse(rec.time), rec.tinker_path);
    if (!rec.ephemeral)
      m.zadd(this.names.tenantIndex(rec.tenant, 'ckpts'), Date.parse(rec.time), rec.tinker_path).persist(this.names.model(rec.model_id)).persist(this.names.gateNext(rec.model_id));
    if (rec.expires_at) m.zadd(this.names.checkpointExpiry(), Date.parse(rec.expires_at), rec.tinker_path);
    else m.zrem(this.names.checkpointExpiry(), rec.tinker_path);
    await m.exec();
  }
  /** Whether Redis holds the checkpoint's record at all (expired or not). */
  async hasRecord(tinkerPath: string): Promise<boolean> {
    return (await this.redis.exists(this.names.checkpoint(tinkerPath))) === 1;
  }
  /** The checkpoint, or null when it does not exist or has expired. */
  async get(tinkerPath: string): Promise<CheckpointRecord | null> {
    const rec = await this.getJson(this.names.checkpoint(tinkerPath), CheckpointRecord);
    if (rec?.expires_at && Date.parse(rec.expires_at) <= Date.now()) return null;
    return rec;
  }
  /**
   * Deletes a checkpoint's record. When it was its model's last listed checkpoint, the model's record
   * gets its lifetime back (`ttlS`, unless it has one: a loaded model's agent keeps refreshing it).
   */
  async deleteRecord(rec: CheckpointRecord, ttlS: number): Promise<void> {
    await this.redis
      .multi()
      .del(this.names.checkpoint(rec.tinker_path))
      .zrem(this.names.modelCheckpoints(rec.model_id), rec.tinker_path)
      .zrem(this.names.tenantIndex(rec.tenant, 'ckpts'), rec.tinker_path)
      .zrem(this.names.checkpointExpiry(), rec.tinker_path)
      .exec();
    if (rec.ephemeral || (await this.ofModel(rec.model_id)).length > 0) return;
    await this.redis.multi().expire(this.names.model(rec.model_id), ttlS, 'NX').expire(this.names.gateNext(rec.model_id), ttlS, 'NX').exec();
  }
  /** A model's listed checkpoints, newest first. */
  async ofModel(modelId: string): Promise<CheckpointRecord[]> {
    return (await this.ofModels([modelId]))[0]!;
  }
  /** The listed checkpoints of each model, newest first, in two round trips however many models. */
  async ofModels(modelIds: string[]): Promise<CheckpointRecord[][]> {
    if (modelIds.length === 0) return [];
    const p = this.redis.pipeline();
    for (const id of modelIds) p.zrevrange(this.names.modelCheckpoints(id), 0, -1);
    const paths = ((await p.exec()) ?? []).map(([err, v]) => (err ? [] : (v as string[])));
    const byPath = new Map((await this.load(paths.flat())).map((c) => [c.tinker_path, c]));
    return paths.map((ps) => ps.flatMap((x) => byPath.get(x) ?? []).filter((c) => !c.ephemeral));
  }
  /** Every listed checkpoint of one tenant, newest first, one page. */
  async list(tenant: string, offset: number, limit: number): Promise<{ checkpoints: CheckpointRecord[]; total: number }> {
    const key = this.names.tenantIndex(tenant, 'ckpts');
    const [paths, total] = await Promise.all([this.redis.zrevrange(key, offset, offset + limit - 1), this.redis.zcard(key)]);
    return { checkpoints: await this.load(paths), total };
  }
  /** Checkpoints whose TTL has run out (their files and records are due for deletion). */
  async expired(limit = 100): Promise<CheckpointRecord[]> {
    const paths = await this.redis.zrangebyscore(this.names.checkpointExpiry(), '-inf', Date.now(), 'LIMIT', 0, limit);
    if (paths.length === 0) return [];
    const raws = await this.redis.mget(paths.map((p) => this.names.checkpoint(p)));
    const out: CheckpointRecord[] = [];
    for (let i = 0; i < paths.length; i++) {
      const raw = raws[i];
      if (raw) out.push(CheckpointRecord.parse(JSON.parse(raw)));
      else await this.redis.zrem(this.names.checkpointExpiry(), paths[i]!);
    }
    return out;
  }
  /** The records of `paths` that exist and have not expired. */
  private async load(paths: string[]): Promise<CheckpointRecord[]> {
    if (paths.length === 0) return [];
    const raws = await this.redis.mget(paths.map((p) => this.names.checkpoint(p)));
    const now = Date.now();
    return raws
      .filter((r): r is string => r !== null)
      .map((r) => CheckpointRecord.parse(JSON.parse(r)))
      .filter((c) => !c.expires_at || Date.parse(c.expires_at) > now);
  }
}
