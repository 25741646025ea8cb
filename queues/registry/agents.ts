import { z } from 'zod';
import { SAMPLE_FEATURES, type SampleFeature } from '../infra/config.js';
import { BrokerError } from '../contract/errors.js';
import { scripts } from '../runtime/scripts.js';
import { RecentReads } from '../infra/recent.js';
import { RedisRegistry } from './store.js';

/**
 * The worker agents and the base models they serve, as the API sees them: the agents' records
 * (written, refreshed and removed by queues/runtime/liveness.ts), the served models they merge into, and the
 * rule that picks the engine kind a sample job goes to (`sampleEngine`). What each engine can do comes
 * from the agents' records (each agent publishes its adapter's registered capabilities,
 * workers/adapters/registry.ts): nothing here names an engine.
 */

export const ServedModel = z.object({
  name: z.string(),
  aliases: z.array(z.string()),
  /** The tokenizer clients load for this model (`get_info`'s tokenizer_id): a hub id or a directory. @defaultValue the model's name (its directory) */
  tokenizer: z.string().optional(),
  arch: z.string(),
  vocab_size: z.number().int(),
  max_context_length: z.number().int(),
  trainable: z.boolean().default(true),
  lora_max_rank: z.number().int().default(64),
  topk_max: z.number().int().default(20),
});
export type ServedModel = z.infer<typeof ServedModel>;

/** An engine's capabilities as its agents publish them (the routing side of workers/adapters/registry.ts EngineCapabilities). */
export const EngineCapabilities = z.object({
  trains: z.boolean(),
  samples: z.boolean(),
  /** Among the engines serving a model, sample jobs go to the highest. */
  sample_priority: z.number(),
  /** Saves its models on a drain for its restart. */
  drains: z.boolean(),
});
export type EngineCapabilities = z.infer<typeof EngineCapabilities>;

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
  /** Sample-request features this agent's engine cannot answer: its engine's, and those it lacks on its device. */
  sample_lacks: z.array(z.enum(SAMPLE_FEATURES)).optional(),
  /** What its engine does (workers/adapters/registry.ts EngineCapabilities). Absent: an agent that trains and samples, at priority 0. */
  capabilities: EngineCapabilities.optional(),
});
export type AgentRecord = z.infer<typeof AgentRecord>;

/** A base model as served here: the merged record, every live agent serving it, those that train it and those that sample it. */
export type Served = { model: ServedModel; agents: AgentRecord[]; trainers: AgentRecord[]; samplers: AgentRecord[] };

/** Whether an agent's engine serves sample jobs (its record says; records without capabilities do). */
export function samples(a: AgentRecord): boolean {
  return a.capabilities?.samples ?? true;
}

/**
 * Where a sample job of `baseModel` goes: the engine kind of highest sampling priority among the
 * live `agents` serving it that sample, can answer the request's fields (`needs`, against each
 * agent's `sample_lacks`) and accept the sampler version's LoRA rank (`loraRank`, null for the base
 * model); ties by name. Thus a torch actor samples only when no rollout (vLLM) agent serves that
 * version, or when the request needs what only it answers. When no agent qualifies, the highest
 * engine serving the model gets the job, and its agent reports the error.
 */
export function sampleEngine(baseModel: string, agents: AgentRecord[], loraRank: number | null, needs: readonly SampleFeature[] = []): string {
  const all = agents.flatMap((a) => a.models.filter((m) => m.name === baseModel).map((m) => ({ a, m })));
  if (all.length === 0) throw new BrokerError('NOT_FOUND', `base model '${baseModel}' is not served here (no live agent serves it)`);
  const serving = all.filter((s) => samples(s.a));
  if (serving.length === 0)
    throw new BrokerError('UNAVAILABLE', `base model '${baseModel}' is served here only by engines that do not sample (${[...new Set(all.map((s) => s.a.engine))].join(', ')}); start an agent whose engine samples it`);
  const able = serving.filter((s) => !needs.some((f) => (s.a.sample_lacks ?? []).includes(f)));
  const candidates = able.length ? able : serving;
  const fits = candidates.filter(({ m }) => loraRank === null || m.lora_max_rank >= loraRank);
  const priority = new Map<string, number>();
  for (const { a } of fits.length ? fits : candidates) priority.set(a.engine, Math.max(priority.get(a.engine) ?? -Infinity, a.capabilities?.sample_priority ?? 0));
  return [...priority.keys()].sort((x, y) => priority.get(y)! - priority.get(x)! || x.localeCompare(y))[0]!;
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
    const [aliveBefore, aliveAfter] = this.names.agentAliveParts();
    const flat = await scripts.agentsLive.run(this.redis, { keys: { agents: this.names.agents() }, args: { aliveBefore, aliveAfter } });
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
   * trainable if any agent trains it (`trainers`), sampled by those whose engine samples (`samplers`),
   * and the bounds are those every agent honours.
   * `fresh`: only agents that beat lately (liveAged).
   */
  async servedModels(fresh = false): Promise<Map<string, Served>> {
    const out = new Map<string, Served>();
    for (const { record: a } of await this.liveAged(fresh)) {
      for (const m of a.models) {
        const e = out.get(m.name);
        if (!e) {
          out.set(m.name, { model: { ...m, aliases: [...m.aliases] }, agents: [a], trainers: m.trainable ? [a] : [], samplers: samples(a) ? [a] : [] });
          continue;
        }
        e.agents.push(a);
        if (m.trainable) e.trainers.push(a);
        if (samples(a)) e.samplers.push(a);
        for (const alias of m.aliases) if (!e.model.aliases.includes(alias)) e.model.aliases.push(alias);
        e.model.trainable ||= m.trainable;
        e.model.max_context_length = Math.min(e.model.max_context_length, m.max_context_length);
        e.model.topk_max = Math.min(e.model.topk_max, m.topk_max);
        if (m.trainable) e.model.lora_max_rank = e.trainers.length === 1 ? m.lora_max_rank : Math.min(e.model.lora_max_rank, m.lora_max_rank);
      }
    }
    return out;
  }
  /** servedModels() reads in flight, shared on the sample path (resolveBaseModel's `share`). */
  private readonly inFlight = new RecentReads<Map<string, Served>>(0, 1);

  /**
   * Resolve a `base_model` given by a client (canonical path or alias); a user error lists what is served.
   * `share`: a read of the served models in flight is shared (its answer no older than one round
   * trip), when it has the model; a model it lacks is looked up afresh. The sample path shares: a
   * burst of sample requests reads the agents (a script, and a parse of every agent's record) once
   * per round trip rather than once each. No answer is reused once it came: a sample routed by an
   * old read would wait on the queue of an engine kind whose last agent left.
   */
  async resolveBaseModel(requested: string, share = false): Promise<Served> {
    const find = (served: Map<string, Served>) => [...served.values()].find((e) => e.model.name === requested || e.model.aliases.includes(requested));
    const read = share ? this.inFlight.get('', () => this.servedModels(), (m) => find(m) !== undefined) : this.servedModels();
    const served = await read;
    const hit = find(served);
    if (hit) return hit;
    const list = [...served.values()].map((e) => [e.model.name, ...e.model.aliases].join(' | '));
    throw new BrokerError(
      'NOT_FOUND',
      `base model '${requested}' is not served here; served models: ${list.length ? list.join('; ') : '(none: no agent is running)'}`,
    );
  }
}
