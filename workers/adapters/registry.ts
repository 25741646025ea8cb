import type { AgentConfig, EngineCatalogue, SampleFeature } from '../../queues/infra/config.js';
import type { Logger } from '../../queues/infra/logger.js';
import type { AgentRecord } from '../../queues/registry/agents.js';
import type { EngineAdapter } from './adapter.js';

/**
 * The engines an agent can drive. Each adapter file registers its engine here once, with what the
 * engine can do (registerEngine); nothing else lists engines or their abilities:
 * - the agent builds its adapter from here and publishes the capabilities in its record
 *   (queues/registry/agents.ts routes sample jobs by the records, not by engine names);
 * - presets (presets/schema.ts, presets/plan.ts) read the engine kinds and what each needs;
 * - config parsing checks TB_ENGINE against the kinds (engineCatalogue).
 * workers/adapters/index.ts loads the built-in adapters, which registers them.
 */

/** A preset model field that only some engines use; presets/schema.ts refuses it on the others. */
export type ModelOption = 'tensor' | 'expert' | 'data' | 'strategy' | 'offload' | 'remove_padding' | 'gradient_checkpointing' | 'load_format';

export type EngineCapabilities = {
  /** Trains LoRA models (the training ops). An engine that does not serves its models frozen. */
  trains: boolean;
  /** Serves sample jobs. An engine that does not consumes no sample queue: its models' samples go to other engines. */
  samples: boolean;
  /** Sample-request features it cannot answer on any device: the API routes those elsewhere, and its agent refuses them. */
  sampleLacks: readonly SampleFeature[];
  /** Samples several jobs in one call (EngineAdapter.sampleBatch): the agent gathers the jobs it holds into batches. */
  sampleBatch: boolean;
  /**
   * Its place among the engines serving one model, for sampling: the API sends a sample job to the
   * highest. It stands for throughput under concurrent requests.
   */
  samplePriority: number;
  /** On a drain, saves each model's training state (weights, AdamW state, gradients); its restart reloads them. */
  drains: boolean;
  /** Runs on GPUs only (a device cuda, cuda:N or cuda:N,M,…). */
  gpuOnly: boolean;
  /**
   * Shares a GPU with other agents' engines (a preset's `gpu_memory` and `take_turns`): it keeps to its
   * share of the GPU and gives memory back when it hands a GPU turn over (EngineAdapter.releaseGpu).
   * @defaultValue false
   */
  sharesGpu?: boolean;
  /**
   * Runs several models' forward_backward in one pass of their base (EngineAdapter.forwardBackwardGroup):
   * a preset agent's `cobatch` applies to it. @defaultValue false
   */
  cobatches?: boolean;
  /** Gives all of its GPU memory back at a hand-over, at a level a preset agent chooses (`sleep_level`: vLLM's sleep mode). @defaultValue false */
  sleeps?: boolean;
  /** How it runs one model over its agent's devices, as a phrase (a preset that asks for another split is told). */
  placement: string;
  /** The preset model fields it uses (presets/schema.ts: `parallelism.*`, `offload`). */
  modelOptions: readonly ModelOption[];
};

/** A preset model as an engine's own checks see it (presets/schema.ts ModelSpec). */
export type PresetModel = { parallelism: { tensor: number; expert: number; data?: number | undefined; strategy?: string | undefined }; offload: boolean; remove_padding?: boolean | undefined };
/** An agent serving a preset model: its id, device and how many GPUs that device names. */
export type PresetAgent = { id: string; device: string; n: number };
/** A problem with a preset field: its path below the model, and the message. */
export type PresetProblem = [(string | number)[], string];

export type EngineDefinition = {
  /** The engine's name: TB_ENGINE, a preset's `engine`, the agents' records and sample queue names. */
  kind: string;
  capabilities: EngineCapabilities;
  /** The engine of a preset model or agent that names none. Exactly one engine says so. */
  isDefault?: boolean;
  /** The adapter of an agent, from the agent's configuration (what the engine needs of it). */
  create(config: AgentConfig, log: Logger): EngineAdapter;
  /** Rules of this engine's own preset fields (beyond "used by this engine or not"). */
  presetProblems?(model: PresetModel, agents: PresetAgent[]): PresetProblem[];
};

const engines = new Map<string, EngineDefinition>();

/** Registers an engine; returns its definition. A kind registered twice is a programming error. */
export function registerEngine<D extends EngineDefinition>(def: D): D {
  if (engines.has(def.kind)) throw new Error(`engine '${def.kind}' is registered twice`);
  if (def.isDefault && [...engines.values()].some((e) => e.isDefault)) throw new Error(`engine '${def.kind}' and '${defaultEngine()}' both say they are the default`);
  engines.set(def.kind, def);
  return def;
}

/** Removes a registered engine (a test's own engine, once the test is done). */
export function unregisterEngine(kind: string): void {
  engines.delete(kind);
}

/** The registered engine kinds, in registration order. */
export function engineKinds(): string[] {
  return [...engines.keys()];
}

/** "torch, vllm and verl": the kinds as a sentence lists them. */
export function kindList(kinds: readonly string[] = engineKinds()): string {
  return kinds.length < 2 ? kinds.join('') : `${kinds.slice(0, -1).join(', ')} and ${kinds.at(-1)}`;
}

/** The registered engine of this kind, or undefined. */
export function findEngine(kind: string): EngineDefinition | undefined {
  return engines.get(kind);
}

/** The registered engine of this kind; an unknown kind throws, naming those available. */
export function engineOf(kind: string): EngineDefinition {
  const e = engines.get(kind);
  if (!e) throw new Error(`engine '${kind}' is not available in this version (${kindList()} are)`);
  return e;
}

/** The engine used when none is named. */
export function defaultEngine(): string {
  const e = [...engines.values()].find((d) => d.isDefault);
  if (!e) throw new Error('no engine is registered as the default');
  return e.kind;
}

/** The kinds whose engines have this capability true, or use this preset option. */
export function kindsWith(test: (c: EngineCapabilities) => boolean): string[] {
  return [...engines.values()].filter((e) => test(e.capabilities)).map((e) => e.kind);
}

/** What config parsing needs of the engines (queues/infra/config.ts names none itself). */
export function engineCatalogue(): EngineCatalogue {
  return { kinds: engineKinds(), default: defaultEngine(), trains: (kind) => engineOf(kind).capabilities.trains };
}

/** The adapter of an agent's engine (`config.engine`, else the default), built by its registration. */
export function createAdapter(config: AgentConfig, log: Logger): EngineAdapter {
  const kind = config.engine ?? defaultEngine();
  const def = engines.get(kind);
  if (!def) throw new Error(`agent ${config.agentId}: engine '${String(kind)}' is not available in this version (${kindList()} are)`);
  return def.create(config, log);
}

/**
 * What an agent publishes of its engine in its record, for the API's routing (queues/registry/agents.ts):
 * every feature it lacks (its engine's and, `deviceLacks`, its adapter's on its device) and the capabilities.
 */
export function recordCapabilities(c: EngineCapabilities, deviceLacks: readonly SampleFeature[] = []): Required<Pick<AgentRecord, 'sample_lacks' | 'capabilities'>> {
  return {
    sample_lacks: [...new Set([...c.sampleLacks, ...deviceLacks])],
    capabilities: { trains: c.trains, samples: c.samples, sample_priority: c.samplePriority, drains: c.drains },
  };
}
