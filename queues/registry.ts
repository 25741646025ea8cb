import type { Redis } from 'ioredis';
import { z } from 'zod';
import { BrokerError } from './errors.js';
import { LoraConfig } from './schemas.js';
import type { Names } from './names.js';

/**
 * The registries kept in Redis: agents (and the base models they serve), sessions,
 * training models and their placement, sampling sessions and sampler versions.
 * Everything the API needs between two requests lives here, so API processes are stateless.
 */

export const ServedModel = z.object({
  name: z.string(),
  aliases: z.array(z.string()),
  arch: z.string(),
  vocab_size: z.number().int(),
  max_context_length: z.number().int(),
});
export type ServedModel = z.infer<typeof ServedModel>;

export const AgentRecord = z.object({
  agent_id: z.string(),
  train_queue: z.string(),
  models: z.array(ServedModel),
  engine: z.string(),
  device: z.string(),
  started_at: z.string(),
});
export type AgentRecord = z.infer<typeof AgentRecord>;

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
});
export type ModelRecord = z.infer<typeof ModelRecord>;

export const SamplingSessionRecord = z.object({
  sampling_session_id: z.string(),
  session_id: z.string(),
  base_model: z.string(),
  model_path: z.string().nullable(),
  adapter_dir: z.string().nullable(),
});
export type SamplingSessionRecord = z.infer<typeof SamplingSessionRecord>;

export const SamplerVersionRecord = z.object({
  tinker_path: z.string(),
  model_id: z.string(),
  base_model: z.string(),
  dir: z.string(),
  created_at: z.string(),
});
export type SamplerVersionRecord = z.infer<typeof SamplerVersionRecord>;

export const FailedFuture = z.object({
  op: z.string(),
  category: z.enum(['user', 'server']),
  message: z.string(),
});
export type FailedFuture = z.infer<typeof FailedFuture>;

/** How long an agent's liveness key lives without a refresh. */
export const AGENT_TTL_MS = 15_000;

export class Registry {
  constructor(
    readonly redis: Redis,
    readonly names: Names,
  ) {}

  private async getJson<T>(key: string, schema: z.ZodType<T>): Promise<T | null> {
    const raw = await this.redis.get(key);
    return raw === null ? null : schema.parse(JSON.parse(raw));
  }

  // ---- agents ----
  async registerAgent(rec: AgentRecord): Promise<void> {
    await this.redis
      .multi()
      .hset(this.names.agents(), rec.agent_id, JSON.stringify(rec))
      .set(this.names.agentAlive(rec.agent_id), '1', 'PX', AGENT_TTL_MS)
      .exec();
  }
  async heartbeatAgent(agentId: string): Promise<void> {
    await this.redis.set(this.names.agentAlive(agentId), '1', 'PX', AGENT_TTL_MS);
  }
  async removeAgent(agentId: string): Promise<void> {
    await this.redis.multi().hdel(this.names.agents(), agentId).del(this.names.agentAlive(agentId)).exec();
  }
  /** Agents whose liveness key is current. */
  async liveAgents(): Promise<AgentRecord[]> {
    const all = await this.redis.hgetall(this.names.agents());
    const recs = Object.values(all).map((v) => AgentRecord.parse(JSON.parse(v)));
    if (recs.length === 0) return [];
    const alive = await this.redis.mget(recs.map((r) => this.names.agentAlive(r.agent_id)));
    return recs.filter((_, i) => alive[i] !== null);
  }
  async isAgentAlive(agentId: string): Promise<boolean> {
    return (await this.redis.exists(this.names.agentAlive(agentId))) === 1;
  }
  /** Every base model served by a live agent, by canonical name. */
  async servedModels(): Promise<Map<string, { model: ServedModel; agents: AgentRecord[] }>> {
    const out = new Map<string, { model: ServedModel; agents: AgentRecord[] }>();
    for (const a of await this.liveAgents()) {
      for (const m of a.models) {
        const e = out.get(m.name) ?? { model: m, agents: [] };
        e.agents.push(a);
        out.set(m.name, e);
      }
    }
    return out;
  }
  /** Resolve a `base_model` given by a client (canonical path or alias); a user error lists what is served. */
  async resolveBaseModel(requested: string): Promise<{ model: ServedModel; agents: AgentRecord[] }> {
    const served = await this.servedModels();
    for (const e of served.values()) {
      if (e.model.name === requested || e.model.aliases.includes(requested)) return e;
    }
    const list = [...served.values()].map((e) => [e.model.name, ...e.model.aliases].join(' | '));
    throw new BrokerError(
      'NOT_FOUND',
      `base model '${requested}' is not served here; served models: ${list.length ? list.join('; ') : '(none: no agent is running)'}`,
    );
  }

  // ---- sessions ----
  async createSession(sessionId: string, info: Record<string, unknown>, ttlS: number): Promise<void> {
    await this.redis
      .multi()
      .set(this.names.session(sessionId), JSON.stringify({ session_id: sessionId, created_at: new Date().toISOString(), ...info }), 'EX', ttlS)
      .zadd(this.names.sessions(), Date.now(), sessionId)
      .exec();
  }
  async touchSession(sessionId: string, ttlS: number): Promise<boolean> {
    return (await this.redis.expire(this.names.session(sessionId), ttlS)) === 1;
  }
  async sessionExists(sessionId: string): Promise<boolean> {
    return (await this.redis.exists(this.names.session(sessionId))) === 1;
  }

  // ---- models ----
  /** Stores the record unless one exists; returns the stored one (create_model is idempotent). */
  async putModelIfAbsent(rec: ModelRecord): Promise<ModelRecord> {
    const ok = await this.redis.set(this.names.model(rec.model_id), JSON.stringify(rec), 'NX');
    if (ok === 'OK') return rec;
    return (await this.getModel(rec.model_id))!;
  }
  async getModel(modelId: string): Promise<ModelRecord | null> {
    return this.getJson(this.names.model(modelId), ModelRecord);
  }
  async requireModel(modelId: string): Promise<ModelRecord> {
    const m = await this.getModel(modelId);
    if (!m) throw new BrokerError('NOT_FOUND', `unknown model_id '${modelId}': create it with create_model first`);
    return m;
  }
  async markModelLost(modelId: string, reason: string): Promise<void> {
    const m = await this.getModel(modelId);
    if (m && m.lost_reason === null) await this.redis.set(this.names.model(modelId), JSON.stringify({ ...m, lost_reason: reason }), 'XX');
  }
  async markModelsLost(agentId: string, reason: string): Promise<string[]> {
    const lost: string[] = [];
    let cursor = '0';
    do {
      const [next, keys] = await this.redis.scan(cursor, 'MATCH', this.names.model('*'), 'COUNT', 200);
      cursor = next;
      for (const key of keys) {
        const raw = await this.redis.get(key);
        if (!raw) continue;
        const m = ModelRecord.parse(JSON.parse(raw));
        if (m.agent_id === agentId && m.lost_reason === null) {
          await this.redis.set(key, JSON.stringify({ ...m, lost_reason: reason }), 'XX');
          lost.push(m.model_id);
        }
      }
    } while (cursor !== '0');
    return lost;
  }

  // ---- futures refused at submission ----
  /**
   * A future that failed before any job existed (its model was lost, its agent is gone): the
   * request still gets a future, as the SDK expects, and retrieving it reports the failure.
   */
  async putFailedFuture(jobId: string, f: FailedFuture, ttlS: number): Promise<void> {
    await this.redis.set(`${this.names.prefix}:failed-future:${jobId}`, JSON.stringify(f), 'EX', ttlS);
  }
  async getFailedFuture(jobId: string): Promise<FailedFuture | null> {
    return this.getJson(`${this.names.prefix}:failed-future:${jobId}`, FailedFuture);
  }

  // ---- sampling sessions and sampler versions ----
  async putSamplingSession(rec: SamplingSessionRecord, ttlS: number): Promise<SamplingSessionRecord> {
    const key = this.names.samplingSession(rec.sampling_session_id);
    const ok = await this.redis.set(key, JSON.stringify(rec), 'EX', ttlS, 'NX');
    if (ok === 'OK') return rec;
    return (await this.getSamplingSession(rec.sampling_session_id))!;
  }
  async getSamplingSession(id: string): Promise<SamplingSessionRecord | null> {
    return this.getJson(this.names.samplingSession(id), SamplingSessionRecord);
  }
  async putSamplerVersion(rec: SamplerVersionRecord): Promise<void> {
    await this.redis.set(this.names.samplerVersion(rec.tinker_path), JSON.stringify(rec));
  }
  async getSamplerVersion(tinkerPath: string): Promise<SamplerVersionRecord | null> {
    return this.getJson(this.names.samplerVersion(tinkerPath), SamplerVersionRecord);
  }
}
