import { z } from 'zod';
import { ENGINE_KINDS, ENGINES, SAMPLE_FEATURES, type SampleFeature } from '../infra/config.js';
import { BrokerError } from '../contract/errors.js';
import { runScript } from '../runtime/scripts.js';
import { RedisRegistry } from './store.js';

/**
 * The worker agents and the base models they serve, as the API sees them: the agents' records
 * (written, refreshed and removed by queues/runtime/liveness.ts), the served models they merge into, and the
 * rule that picks the engine kind a sample job goes to (`sampleEngine`).
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
  /** One per process start: the liveness key holds it (queues/runtime/liveness.ts). */
  incarnation: z.string().optional(),
  /** Liveness timeout in seconds: the liveness key's TTL. */
  timeout_s: z.number().optional(),
  host: z.string().optional(),
  pid: z.number().int().optional(),
  /** Sample-request features this agent's engine cannot answer on its device, beyond its kind's (ENGINES). */
  sample_lacks: z.array(z.enum(SAMPLE_FEATURES)).optional(),
});
export type AgentRecord = z.infer<typeof AgentRecord>;

/** A base model as served here: the merged record, every live agent serving it, and those that train it. */
export type Served = { model: ServedModel; agents: AgentRecord[]; trainers: AgentRecord[] };

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

/** An agent's heartbeat period: a fifth of its timeout (queues/runtime/liveness.ts), at least 200 ms. */
export function heartbeatMs(timeoutS: number): number {
  return Math.max(200, Math.round((timeoutS * 1000) / 5));
}

/** Reads the agents' records (`<prefix>:agents`) and liveness keys. */
export class AgentRegistry extends RedisRegistry {
  /** Agents whose liveness key is current (one round trip). */
  async live(): Promise<AgentRecord[]> {
    return (await this.liveAged()).map((a) => a.record);
  }
  /**
   * Live agents with the age of their last heartbeat (Redis's clock). `fresh`: only those that beat
   * within two and a half heartbeats (the heartbeat is a fifth of the agent's timeout): a dead
   * agent's key lives on for up to its timeout, and /healthz must not call a node ready on it.
   */
  async liveAged(fresh = false): Promise<{ record: AgentRecord; ageMs: number }[]> {
    const flat = (await runScript(this.redis, 'agents-live', [this.names.agents()], this.names.agentAliveParts())) as (string | number)[];
    const out: { record: AgentRecord; ageMs: number }[] = [];
    for (let i = 0; i + 1 < flat.length; i += 2) {
      const record = AgentRecord.parse(JSON.parse(String(flat[i])));
      const ageMs = Number(flat[i + 1]);
      if (fresh && ageMs > 2.5 * heartbeatMs(record.timeout_s ?? 30)) continue;
      out.push({ record, ageMs });
    }
    return out;
  }
  /**
   * Every base model served by a live agent, by canonical name. Agents serving one model directory
   * under different names (an actor and its rollout agents) merge: every alias resolves, the model is
   * trainable if any agent trains it (`trainers`), and the bounds are those every agent honours.
   * `fresh`: only agents that beat lately (liveAged).
   */
  async servedModels(fresh = false): Promise<Map<string, Served>> {
    const out = new Map<string, Served>();
    for (const { record: a } of await this.liveAged(fresh)) {
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
  async resolveBaseModel(requested: string): Promise<Served> {
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
}
