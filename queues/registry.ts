import type { Redis } from 'ioredis';
import { z } from 'zod';
import { ENGINE_KINDS, ENGINES, SAMPLE_FEATURES, type SampleFeature } from './config.js';
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
  trainable: z.boolean().default(true),
  lora_max_rank: z.number().int().default(64),
  topk_max: z.number().int().default(20),
});
export type ServedModel = z.infer<typeof ServedModel>;

export const AgentRecord = z.object({
  agent_id: z.string(),
  train_queue: z.string(),
  models: z.array(ServedModel),
  engine: z.string(),
  device: z.string(),
  started_at: z.string(),
  /** One per process start: the liveness key holds it (queues/liveness.ts). */
  incarnation: z.string().optional(),
  /** Liveness timeout in seconds: the liveness key's TTL. */
  timeout_s: z.number().optional(),
  host: z.string().optional(),
  pid: z.number().int().optional(),
  /** Sample-request features this agent's engine cannot answer on its device, beyond its kind's (ENGINES). */
  sample_lacks: z.array(z.enum(SAMPLE_FEATURES)).optional(),
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
  /** The tenant (API key) that owns the model; `''` (records older than tenants) belongs to none. */
  tenant: z.string().default(''),
  /** The base model's context length when the model was placed; null for records older than this field. */
  max_context_length: z.number().int().nullable().default(null),
});
export type ModelRecord = z.infer<typeof ModelRecord>;

export const SamplingSessionRecord = z.object({
  sampling_session_id: z.string(),
  session_id: z.string(),
  base_model: z.string(),
  model_path: z.string().nullable(),
  adapter_dir: z.string().nullable(),
  /** An inflight session samples its model's current inflight target (Registry.inflightTarget). */
  inflight_model_id: z.string().nullish(),
  /** The owning tenant, as for models. */
  tenant: z.string().default(''),
});
export type SamplingSessionRecord = z.infer<typeof SamplingSessionRecord>;

export const InflightTarget = z.object({ model_path: z.string(), adapter_dir: z.string(), seq_id: z.number().int() });
export type InflightTarget = z.infer<typeof InflightTarget>;

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

export const FailedFuture = z.object({
  op: z.string(),
  category: z.enum(['user', 'server', 'unknown']),
  code: z.string().optional(),
  message: z.string(),
});
export type FailedFuture = z.infer<typeof FailedFuture>;

/**
 * Engines by sampling throughput under concurrent requests, fastest first. vLLM batches every request
 * it holds (continuous batching); the torch engine runs one sample request at a time, so an actor
 * that shares a sample queue with rollout agents sets the pace of everyone's requests. Engines not
 * listed come after these.
 */
const SAMPLE_ENGINE_ORDER: readonly string[] = ['vllm', 'torch'];
/** Engines that do not sample: their agents consume no sample queue. */
const TRAIN_ONLY_ENGINES: readonly string[] = ENGINE_KINDS.filter((e) => !ENGINES[e].samples);

/** Whether an engine kind cannot answer a sample request using `feature`. */
function engineLacks(engine: string, feature: SampleFeature): boolean {
  const e = (ENGINES as Record<string, { sampleLacks: readonly SampleFeature[] }>)[engine];
  return !!e && e.sampleLacks.includes(feature);
}

/**
 * Where a sample job of `baseModel` goes: the fastest engine kind among the live `agents` serving it
 * that can answer the request's fields (`needs`: prompt_alt_tokens_k and target_prompt_logprobs only
 * the torch engine answers; lm_head_prompt_logprobs not a vLLM agent on a GPU) and accept the sampler version's LoRA rank (`loraRank`, null for the base
 * model). The torch actor thus samples only when no rollout (vLLM) agent serves that version, or when
 * the request needs what only it answers. When no agent qualifies, the fastest engine serving the
 * model gets the job, and its engine reports the error.
 */
export function sampleEngine(baseModel: string, agents: AgentRecord[], loraRank: number | null, needs: readonly SampleFeature[] = []): string {
  const all = agents.flatMap((a) => a.models.filter((m) => m.name === baseModel).map((m) => ({ engine: a.engine, lacks: a.sample_lacks ?? [], m })));
  if (all.length === 0) throw new BrokerError('NOT_FOUND', `base model '${baseModel}' is not served here (no live agent serves it)`);
  const serving = all.filter((s) => !TRAIN_ONLY_ENGINES.includes(s.engine));
  if (serving.length === 0)
    throw new BrokerError('UNAVAILABLE', `base model '${baseModel}' is served here only by engines that do not sample (${[...new Set(all.map((s) => s.engine))].join(', ')}); start a vLLM or torch agent for it`);
  const able = serving.filter((s) => !needs.some((f) => engineLacks(s.engine, f) || s.lacks.includes(f)));
  const candidates = able.length ? able : serving;
  const fits = candidates.filter(({ m }) => loraRank === null || m.lora_max_rank >= loraRank);
  const pool = (fits.length ? fits : candidates).map((s) => s.engine);
  const rank = (e: string) => (SAMPLE_ENGINE_ORDER.includes(e) ? SAMPLE_ENGINE_ORDER.indexOf(e) : SAMPLE_ENGINE_ORDER.length);
  return [...new Set(pool)].sort((a, b) => rank(a) - rank(b) || a.localeCompare(b))[0]!;
}

export class Registry {
  constructor(
    readonly redis: Redis,
    readonly names: Names,
  ) {}

  private async getJson<T>(key: string, schema: z.ZodType<T>): Promise<T | null> {
    const raw = await this.redis.get(key);
    return raw === null ? null : schema.parse(JSON.parse(raw));
  }

  // ---- agents (registered, refreshed and removed by queues/liveness.ts) ----
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
  /**
   * Every base model served by a live agent, by canonical name. Agents serving one model directory
   * under different names (an actor and its rollout agents) merge: every alias resolves, the model is
   * trainable if any agent trains it (`trainers`), and the bounds are those every agent honours.
   */
  async servedModels(): Promise<Map<string, { model: ServedModel; agents: AgentRecord[]; trainers: AgentRecord[] }>> {
    const out = new Map<string, { model: ServedModel; agents: AgentRecord[]; trainers: AgentRecord[] }>();
    for (const a of await this.liveAgents()) {
      for (const m of a.models) {
        const e = out.get(m.name);
        if (!e) {
          out.set(m.name, { model: { ...m, aliases: [...m.aliases] }, agents: [a], trainers: m.trainable ? [a] : [] });
          continue;
        }
        e.agents.push(a);
        if (m.trainable) e.trainers.push(a);
        for (const alias of m.aliases) if (!e.model.aliases.includes(alias)) e.model.aliases.push(alias);
        e.model.trainable ||= m.trainable;
        e.model.max_context_length = Math.min(e.model.max_context_length, m.max_context_length);
        e.model.topk_max = Math.min(e.model.topk_max, m.topk_max);
        if (m.trainable) e.model.lora_max_rank = e.trainers.length === 1 ? m.lora_max_rank : Math.min(e.model.lora_max_rank, m.lora_max_rank);
      }
    }
    return out;
  }
  /** Resolve a `base_model` given by a client (canonical path or alias); a user error lists what is served. */
  async resolveBaseModel(requested: string): Promise<{ model: ServedModel; agents: AgentRecord[]; trainers: AgentRecord[] }> {
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
  async createSession(sessionId: string, tenant: string, info: Record<string, unknown>, ttlS: number): Promise<void> {
    await this.redis
      .multi()
      .set(this.names.session(sessionId), JSON.stringify({ session_id: sessionId, created_at: new Date().toISOString(), ...info, tenant }), 'EX', ttlS)
      .zadd(this.names.tenantIndex(tenant, 'sessions'), Date.now(), sessionId)
      .sadd(this.names.tenants(), tenant)
      .exec();
  }
  /** The tenant owning a live session, or null when the session does not exist. */
  async sessionTenant(sessionId: string): Promise<string | null> {
    const info = await this.sessionInfo(sessionId);
    return info === null ? null : typeof info.tenant === 'string' ? info.tenant : '';
  }
  /** A heartbeat: the session and what it lists (its models, samplers and finish record) live another `ttlS`. */
  async touchSession(sessionId: string, ttlS: number): Promise<boolean> {
    const key = this.names.session(sessionId);
    const r = await this.redis.multi().expire(key, ttlS).expire(`${key}:models`, ttlS).expire(`${key}:samplers`, ttlS).expire(`${key}:finish`, ttlS).exec();
    return r?.[0]?.[1] === 1;
  }
  async sessionExists(sessionId: string): Promise<boolean> {
    return (await this.redis.exists(this.names.session(sessionId))) === 1;
  }

  // ---- models ----
  /** Stores the record (for `ttlS`) unless one exists; returns the stored one (create_model is idempotent). */
  async putModelIfAbsent(rec: ModelRecord, ttlS: number): Promise<ModelRecord> {
    const ok = await this.redis.set(this.names.model(rec.model_id), JSON.stringify(rec), 'EX', ttlS, 'NX');
    if (ok === 'OK') return rec;
    return (await this.getModel(rec.model_id))!;
  }
  async getModel(modelId: string): Promise<ModelRecord | null> {
    return this.getJson(this.names.model(modelId), ModelRecord);
  }
  async markModelLost(modelId: string, reason: string): Promise<void> {
    const m = await this.getModel(modelId);
    if (m && m.lost_reason === null) await this.redis.set(this.names.model(modelId), JSON.stringify({ ...m, lost_reason: reason }), 'KEEPTTL', 'XX');
  }
  /**
   * The models stay at least `ttlS` more (never less than they had; a model kept without a TTL
   * stays so): what an agent's heartbeat does for the models loaded on it, so a model in use never
   * expires. The record and the gate's next seq_id share one lifetime.
   */
  async keepModels(modelIds: Iterable<string>, ttlS: number): Promise<void> {
    const p = this.redis.pipeline();
    for (const id of modelIds) p.expire(this.names.model(id), ttlS, 'GT').expire(this.names.gateNext(id), ttlS, 'GT');
    if (p.length) await p.exec();
  }
  async markModelsLost(agentId: string, reason: string, except: ReadonlySet<string> = new Set()): Promise<string[]> {
    const lost: string[] = [];
    let cursor = '0';
    do {
      const [next, keys] = await this.redis.scan(cursor, 'MATCH', this.names.model('*'), 'COUNT', 200);
      cursor = next;
      for (const key of keys) {
        const raw = await this.redis.get(key);
        if (!raw) continue;
        const m = ModelRecord.parse(JSON.parse(raw));
        if (m.agent_id === agentId && m.lost_reason === null && !except.has(m.model_id)) {
          await this.redis.set(key, JSON.stringify({ ...m, lost_reason: reason }), 'KEEPTTL', 'XX');
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
    await this.redis.set(this.names.failedFuture(jobId), JSON.stringify(f), 'EX', ttlS);
  }
  async getFailedFuture(jobId: string): Promise<FailedFuture | null> {
    return this.getJson(this.names.failedFuture(jobId), FailedFuture);
  }

  // ---- future ownership ----
  /**
   * Records which tenant a future (`request_id`) belongs to. The first owner stays (a repeated
   * submission by the same tenant changes nothing); the record outlives the job's retention.
   */
  async setFutureOwner(requestId: string, tenant: string, ttlS: number): Promise<void> {
    await this.redis.set(this.names.futureOwner(requestId), tenant, 'EX', ttlS, 'NX');
  }
  async futureOwner(requestId: string): Promise<string | null> {
    return this.redis.get(this.names.futureOwner(requestId));
  }

  // ---- sampling sessions and sampler versions ----
  async putSamplingSession(rec: SamplingSessionRecord, ttlS: number): Promise<SamplingSessionRecord> {
    const key = this.names.samplingSession(rec.sampling_session_id);
    const ok = await this.redis.set(key, JSON.stringify(rec), 'EX', ttlS, 'NX');
    if (ok === 'OK') return rec;
    return (await this.getSamplingSession(rec.sampling_session_id))!;
  }
  /** The model's inflight sampler target: its newest `kind: inflight` save (saves of a model run in order). */
  async setInflightTarget(modelId: string, target: InflightTarget, ttlS: number): Promise<void> {
    await this.redis.set(this.names.inflight(modelId), JSON.stringify(target), 'EX', ttlS);
  }
  async inflightTarget(modelId: string): Promise<InflightTarget | null> {
    return this.getJson(this.names.inflight(modelId), InflightTarget);
  }

  async getSamplingSession(id: string): Promise<SamplingSessionRecord | null> {
    return this.getJson(this.names.samplingSession(id), SamplingSessionRecord);
  }
  /** A sample request through the session: it lives another `ttlS`. */
  async touchSamplingSession(id: string, ttlS: number): Promise<void> {
    await this.redis.expire(this.names.samplingSession(id), ttlS);
  }
  // ---- checkpoints ----
  private ckptKey(tinkerPath: string): string {
    return this.names.checkpoint(tinkerPath);
  }
  private modelCkpts(modelId: string): string {
    return this.names.modelCheckpoints(modelId);
  }
  private allCkpts(tenant: string): string {
    return this.names.tenantIndex(tenant, 'ckpts');
  }
  private ckptExpiry(): string {
    return this.names.checkpointExpiry();
  }

  /** Stores a checkpoint's record; a listed (named) one keeps its model's record without a TTL while it exists. */
  async putCheckpoint(rec: CheckpointRecord): Promise<void> {
    const m = this.redis
      .multi()
      .set(this.ckptKey(rec.tinker_path), JSON.stringify(rec))
      .zadd(this.modelCkpts(rec.model_id), Date.parse(rec.time), rec.tinker_path);
    if (!rec.ephemeral) m.zadd(this.allCkpts(rec.tenant), Date.parse(rec.time), rec.tinker_path).persist(this.names.model(rec.model_id)).persist(this.names.gateNext(rec.model_id));
    if (rec.expires_at) m.zadd(this.ckptExpiry(), Date.parse(rec.expires_at), rec.tinker_path);
    else m.zrem(this.ckptExpiry(), rec.tinker_path);
    await m.exec();
  }
  /** Whether Redis holds the checkpoint's record at all (expired or not). */
  async hasCheckpointRecord(tinkerPath: string): Promise<boolean> {
    return (await this.redis.exists(this.ckptKey(tinkerPath))) === 1;
  }
  /** The checkpoint, or null when it does not exist or has expired. */
  async getCheckpoint(tinkerPath: string): Promise<CheckpointRecord | null> {
    const rec = await this.getJson(this.ckptKey(tinkerPath), CheckpointRecord);
    if (rec?.expires_at && Date.parse(rec.expires_at) <= Date.now()) return null;
    return rec;
  }
  /**
   * Deletes a checkpoint's record. When it was its model's last listed checkpoint, the model's record
   * gets its lifetime back (`ttlS`, unless it has one: a loaded model's agent keeps refreshing it).
   */
  async deleteCheckpointRecord(rec: CheckpointRecord, ttlS: number): Promise<void> {
    await this.redis
      .multi()
      .del(this.ckptKey(rec.tinker_path))
      .zrem(this.modelCkpts(rec.model_id), rec.tinker_path)
      .zrem(this.allCkpts(rec.tenant), rec.tinker_path)
      .zrem(this.ckptExpiry(), rec.tinker_path)
      .exec();
    if (rec.ephemeral || (await this.listModelCheckpoints(rec.model_id)).length > 0) return;
    await this.redis.multi().expire(this.names.model(rec.model_id), ttlS, 'NX').expire(this.names.gateNext(rec.model_id), ttlS, 'NX').exec();
  }
  /** A model's listed checkpoints, newest first. */
  async listModelCheckpoints(modelId: string): Promise<CheckpointRecord[]> {
    return (await this.checkpointsOfModels([modelId]))[0]!;
  }
  /** The listed checkpoints of each model, newest first, in two round trips however many models. */
  async checkpointsOfModels(modelIds: string[]): Promise<CheckpointRecord[][]> {
    if (modelIds.length === 0) return [];
    const p = this.redis.pipeline();
    for (const id of modelIds) p.zrevrange(this.modelCkpts(id), 0, -1);
    const paths = ((await p.exec()) ?? []).map(([err, v]) => (err ? [] : (v as string[])));
    const byPath = new Map((await this.loadCheckpoints(paths.flat())).map((c) => [c.tinker_path, c]));
    return paths.map((ps) => ps.flatMap((x) => byPath.get(x) ?? []).filter((c) => !c.ephemeral));
  }
  /** Every listed checkpoint of one tenant, newest first, one page. */
  async listAllCheckpoints(tenant: string, offset: number, limit: number): Promise<{ checkpoints: CheckpointRecord[]; total: number }> {
    const key = this.allCkpts(tenant);
    const [paths, total] = await Promise.all([this.redis.zrevrange(key, offset, offset + limit - 1), this.redis.zcard(key)]);
    return { checkpoints: await this.loadCheckpoints(paths), total };
  }
  private async loadCheckpoints(paths: string[]): Promise<CheckpointRecord[]> {
    if (paths.length === 0) return [];
    const raws = await this.redis.mget(paths.map((p) => this.ckptKey(p)));
    const now = Date.now();
    return raws
      .filter((r): r is string => r !== null)
      .map((r) => CheckpointRecord.parse(JSON.parse(r)))
      .filter((c) => !c.expires_at || Date.parse(c.expires_at) > now);
  }
  /** Checkpoints whose TTL has run out (their files and records are due for deletion). */
  async expiredCheckpoints(limit = 100): Promise<CheckpointRecord[]> {
    const paths = await this.redis.zrangebyscore(this.ckptExpiry(), '-inf', Date.now(), 'LIMIT', 0, limit);
    if (paths.length === 0) return [];
    const raws = await this.redis.mget(paths.map((p) => this.ckptKey(p)));
    const out: CheckpointRecord[] = [];
    for (let i = 0; i < paths.length; i++) {
      const raw = raws[i];
      if (raw) out.push(CheckpointRecord.parse(JSON.parse(raw)));
      else await this.redis.zrem(this.ckptExpiry(), paths[i]!);
    }
    return out;
  }

  // ---- listings ----
  /** Lists a model under its tenant and its session (whose set lives `ttlS`, as the session does). */
  async indexModel(rec: ModelRecord, ttlS: number): Promise<void> {
    const set = `${this.names.session(rec.session_id)}:models`;
    await this.redis
      .multi()
      .zadd(this.names.tenantIndex(rec.tenant, 'models'), Date.parse(rec.created_at), rec.model_id)
      .sadd(this.names.tenants(), rec.tenant)
      .sadd(set, rec.model_id)
      .expire(set, ttlS)
      .exec();
  }
  async touchModel(modelId: string): Promise<void> {
    await this.redis.hset(this.names.modelLast(), modelId, new Date().toISOString());
  }
  async modelLastRequest(modelIds: string[]): Promise<(string | null)[]> {
    if (modelIds.length === 0) return [];
    return this.redis.hmget(this.names.modelLast(), ...modelIds);
  }
  /** One tenant's models (training runs), newest first, one page. */
  async listModels(tenant: string, offset: number, limit: number): Promise<{ models: ModelRecord[]; total: number }> {
    const key = this.names.tenantIndex(tenant, 'models');
    const [ids, total] = await Promise.all([this.redis.zrevrange(key, offset, offset + limit - 1), this.redis.zcard(key)]);
    const raws = ids.length ? await this.redis.mget(ids.map((id) => this.names.model(id))) : [];
    const models = raws.flatMap((raw) => (raw === null ? [] : [ModelRecord.parse(JSON.parse(raw))]));
    return { models, total };
  }
  async indexSampler(sessionId: string, samplerId: string, ttlS: number): Promise<void> {
    const set = `${this.names.session(sessionId)}:samplers`;
    await this.redis.multi().sadd(set, samplerId).expire(set, ttlS).exec();
  }
  async sessionMembers(sessionId: string): Promise<{ training_run_ids: string[]; sampler_ids: string[] }> {
    const [models, samplers] = await Promise.all([
      this.redis.smembers(`${this.names.session(sessionId)}:models`),
      this.redis.smembers(`${this.names.session(sessionId)}:samplers`),
    ]);
    return { training_run_ids: models.sort(), sampler_ids: samplers.sort() };
  }
  /** One tenant's sessions, newest first. */
  async listSessions(tenant: string, offset: number, limit: number): Promise<string[]> {
    return this.redis.zrevrange(this.names.tenantIndex(tenant, 'sessions'), offset, offset + limit - 1);
  }
  /** ServiceClient.close(): the first finish record stays, for as long as the session (`ttlS`). */
  async finishSession(sessionId: string, finish: Record<string, unknown>, ttlS: number): Promise<Record<string, unknown>> {
    const key = `${this.names.session(sessionId)}:finish`;
    await this.redis.set(key, JSON.stringify(finish), 'EX', ttlS, 'NX');
    return JSON.parse((await this.redis.get(key))!);
  }
  async sessionFinished(sessionId: string): Promise<boolean> {
    return (await this.redis.exists(`${this.names.session(sessionId)}:finish`)) === 1;
  }
  async sessionInfo(sessionId: string): Promise<Record<string, unknown> | null> {
    return (await this.sessionInfos([sessionId]))[0] ?? null;
  }
  /** Session records by id (null where gone), in one round trip. */
  async sessionInfos(sessionIds: string[]): Promise<(Record<string, unknown> | null)[]> {
    return this.mgetJson(sessionIds.map((id) => this.names.session(id)));
  }
  /** Finish records by session id (null where the session has not finished), in one round trip. */
  async sessionFinishes(sessionIds: string[]): Promise<(Record<string, unknown> | null)[]> {
    return this.mgetJson(sessionIds.map((id) => `${this.names.session(id)}:finish`));
  }
  /** How many listed checkpoints the training runs of each session hold, in three round trips. */
  async sessionCheckpointCounts(sessionIds: string[]): Promise<number[]> {
    if (sessionIds.length === 0) return [];
    const p = this.redis.pipeline();
    for (const id of sessionIds) p.smembers(`${this.names.session(id)}:models`);
    const models = ((await p.exec()) ?? []).map(([err, v]) => (err ? [] : (v as string[])));
    const ckpts = await this.checkpointsOfModels(models.flat());
    let at = 0;
    return models.map((ms) => ms.reduce((n) => n + ckpts[at++]!.length, 0));
  }
  /**
   * The listing sweep (every API process runs it, api/app.ts): drops the entries whose record is gone
   * (expired) from the tenants' session and model listings, from the model and sampler sets of live
   * sessions, and from the models' last-request times. Walks every listing in chunks (ZSCAN/SSCAN,
   * one pipelined EXISTS per chunk); returns how many entries it dropped.
   */
  async pruneListings(chunk = 500): Promise<number> {
    let dropped = 0;
    // Members of `key` (a sorted set or a set) whose record (`recordKey`) is gone; `gone` removes them.
    const sweep = async (key: string, sorted: boolean, recordKey: (id: string) => string, gone: (ids: string[]) => Promise<unknown>, live?: (ids: string[]) => Promise<void>) => {
      let cursor = '0';
      do {
        const [next, flat] = sorted ? await this.redis.zscan(key, cursor, 'COUNT', chunk) : await this.redis.sscan(key, cursor, 'COUNT', chunk);
        cursor = next;
        const ids = sorted ? flat.filter((_, i) => i % 2 === 0) : flat;
        if (ids.length === 0) continue;
        const p = this.redis.pipeline();
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
    for (const tenant of await this.redis.smembers(this.names.tenants())) {
      await sweep(
        this.names.tenantIndex(tenant, 'sessions'),
        true,
        (id) => this.names.session(id),
        (ids) => this.redis.zrem(this.names.tenantIndex(tenant, 'sessions'), ...ids),
        async (sessions) => {
          // The model and sampler sets of a chunk of live sessions, in three round trips.
          const sets = sessions.flatMap((s) => [
            { key: `${this.names.session(s)}:models`, record: (id: string) => this.names.model(id) },
            { key: `${this.names.session(s)}:samplers`, record: (id: string) => this.names.samplingSession(id) },
          ]);
          const members = await this.pipelined(sets.map((x) => ['smembers', x.key]));
          const entries = sets.flatMap((x, i) => ((members[i] as string[] | null) ?? []).map((id) => ({ key: x.key, id, record: x.record(id) })));
          const exists = await this.pipelined(entries.map((e) => ['exists', e.record]));
          const missing = entries.filter((_, i) => exists[i] === 0);
          if (missing.length) await this.pipelined(missing.map((e) => ['srem', e.key, e.id]));
          dropped += missing.length;
        },
      );
      await sweep(
        this.names.tenantIndex(tenant, 'models'),
        true,
        (id) => this.names.model(id),
        (ids) => this.redis.multi().zrem(this.names.tenantIndex(tenant, 'models'), ...ids).hdel(this.names.modelLast(), ...ids).exec(),
      );
    }
    return dropped;
  }
  /** Commands in one pipeline; each one's reply (null where it failed). */
  private async pipelined(cmds: string[][]): Promise<unknown[]> {
    if (cmds.length === 0) return [];
    return ((await this.redis.pipeline(cmds).exec()) ?? []).map(([err, v]) => (err ? null : v));
  }
  private async mgetJson(keys: string[]): Promise<(Record<string, unknown> | null)[]> {
    if (keys.length === 0) return [];
    return (await this.redis.mget(keys)).map((raw) => (raw === null ? null : JSON.parse(raw)));
  }
}
