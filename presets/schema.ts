import { readFileSync } from 'node:fs';
import path from 'node:path';
import YAML from 'yaml';
import { z } from 'zod';
import { COBATCH_LIMITS, deviceGpus, MODEL_DTYPES } from '../queues/infra/config.js';
import { defaultEngine, engineKinds, findEngine, kindsWith, type ModelOption, type PresetProblem } from '../workers/adapters/index.js';
import { VERL_STRATEGIES } from '../workers/adapters/verl.js';

/**
 * Launch presets: one YAML file describes a whole setup (models and their roles, engines, the
 * agents that serve them on which node and devices, Redis, the API, storage). Parsed once by
 * this schema; an invalid preset stops before anything starts, with the path of the bad field.
 */

export const ModelRole = z.enum(['actor', 'rollout', 'reference', 'teacher']);
export type ModelRole = z.infer<typeof ModelRole>;

/** A registered engine (workers/adapters/registry.ts), looked up when a preset is parsed. */
export const Engine = z.string().refine((kind) => findEngine(kind) !== undefined, {
  error: () => `Invalid option: expected one of ${engineKinds().map((k) => JSON.stringify(k)).join('|')}`,
  abort: true,
});
export type Engine = z.infer<typeof Engine>;

const Device = z
  .string()
  .regex(/^(cpu|cuda(:\d+(,\d+)*)?)$/, 'a device is cpu, cuda, cuda:N or cuda:N,M,… (the GPUs of one agent)');

export const ModelSpec = z
  .object({
    /** The name clients pass as `base_model` (an alias of the path). */
    name: z.string().min(1),
    /** A local directory (relative paths are resolved against the preset's directory, then the working directory). */
    path: z.string().min(1),
    role: ModelRole,
    /**
     * What `get_info` names as the tokenizer (`tokenizer_id`), which a client's `get_tokenizer()` loads
     * with `transformers.AutoTokenizer`: the hub id for a real model (e.g. `Qwen/Qwen3-8B`), so a client
     * on another machine loads it from the hub or its cache; a directory for a local model.
     * @defaultValue the model's resolved `path`
     */
    tokenizer: z.string().min(1).optional(),
    /** @defaultValue the registered default engine (torch) */
    engine: Engine.default(() => defaultEngine()),
    /** How the engine splits the model over the agent's GPUs; each field applies to one engine, and is refused on the others (`parallelismProblems`). */
    parallelism: z
      .object({
        /** vllm: GPUs one model is split over (`--tensor-parallel-size`). @defaultValue 1 */
        tensor: z.number().int().positive().default(1),
        /** Not available in this version: only 1 is accepted. @defaultValue 1 */
        pipeline: z.number().int().positive().default(1),
        /** verl: the GPUs FSDP shards the model over, which are those of its agent's device (when given, it must equal their count). */
        data: z.number().int().positive().optional(),
        /** vllm: 1 (off), or the tensor size to run the experts expert-parallel over those GPUs (`--enable-expert-parallel`). @defaultValue 1 */
        expert: z.number().int().positive().default(1),
        /** verl: the training strategy (verl's FSDP2 or FSDP engine, or its VeOmni engine). @defaultValue `fsdp2` */
        strategy: z.enum(VERL_STRATEGIES as [string, ...string[]], { error: `verl strategies available in this version: ${VERL_STRATEGIES.join(', ')} (megatron is not)` }).optional(),
      })
      .strict()
      .default({ tensor: 1, pipeline: 1, expert: 1 }),
    /** Largest LoRA rank a client may ask for (actors). @defaultValue 64 */
    lora_max_rank: z.number().int().positive().default(64),
    /** Largest K of top-K prompt logprobs (teachers, reference). @defaultValue 20 */
    topk_max: z.number().int().positive().default(20),
    /** verl: parameters and optimizer state in CPU memory between steps (verl's param and optimizer offload). @defaultValue false */
    offload: z.boolean().default(false),
    /**
     * verl: padding removed (verl's `use_remove_padding`: each micro-batch's rows packed into one, no
     * padding computed). @defaultValue the agent's TB_VERL_REMOVE_PADDING (`auto`: on where a
     * variable-length attention kernel runs)
     */
    remove_padding: z.boolean().optional(),
    /**
     * verl: gradient checkpointing. @defaultValue the agent's TB_VERL_GRAD_CKPT (`auto`: chosen from the
     * model's size and the GPU's memory, printed as the model is built)
     */
    gradient_checkpointing: z.boolean().optional(),
    /**
     * vllm: `dummy` starts the model from its config.json alone with random weights (`--load-format
     * dummy`): for benchmarks of a shape whose weights are not on disk; its answers are noise, and the
     * agent says so in its log. @defaultValue the weights in the directory
     */
    load_format: z.enum(['dummy']).optional(),
    /** Weight dtype on the device. @defaultValue engine's choice (float32 on CPU, bfloat16 on GPU) */
    dtype: z.enum(MODEL_DTYPES).optional(),
  })
  .strict();
export type ModelSpec = z.infer<typeof ModelSpec>;

export const AgentSpec = z
  .object({
    /** Stable agent id (its training queue is `train-<id>`). */
    id: z.string().regex(/^[a-zA-Z0-9_.-]+$/, 'agent ids use letters, digits, _ . -'),
    /** The node (host) the agent runs on; `start --node` starts that node's agents. @defaultValue `local` */
    node: z.string().default('local'),
    device: Device.default('cpu'),
    /** Names of the models (above) this agent serves. */
    models: z.array(z.string()).min(1),
    /** Sample jobs this agent runs at once. @defaultValue 64 */
    sample_concurrency: z.number().int().positive().default(64),
    /**
     * The share of each of its GPUs this agent's engine may use, 0 < x ≤ 1 (torch: its allocator's cap;
     * vLLM: `--gpu-memory-utilization`). Required on a GPU that several agents share.
     * @defaultValue the engine's own (torch: the whole GPU; vLLM: 0.9)
     */
    gpu_memory: z.number().gt(0).max(1).optional(),
    /**
     * Take turns on its GPU with the other agents there that take turns (workers/gpu-turns.ts): one
     * engine's phase at a time, the other giving its memory back meanwhile (vLLM sleeps; torch empties its
     * allocator's cache), so their `gpu_memory` may add up to more than 1. On a device `cpu`, the agents
     * of the node that take turns run one phase at a time. @defaultValue false
     */
    take_turns: z.boolean().default(false),
    /**
     * vllm taking turns: its sleep level at a hand-over (1: weights to CPU memory, KV cache dropped;
     * 2: both dropped, the weights read again at wake-up: less CPU memory, a slower wake-up).
     * @defaultValue 1
     */
    sleep_level: z.union([z.literal(1), z.literal(2)]).optional(),
    /**
     * Co-batching (docs/architecture.md): up to `max` forward_backward ops of different models on one
     * base model in one engine pass (TB_COBATCH_MAX), a pass waiting up to `wait_ms` for the loops
     * training here to queue theirs (TB_COBATCH_WAIT_MS). For many users' small batches on one base.
     * @defaultValue the agent's TB_COBATCH_MAX and TB_COBATCH_WAIT_MS (4 ops, no wait: only ops already queued)
     */
    cobatch: z
      .object({
        max: z.number().int().min(1).max(COBATCH_LIMITS.max),
        wait_ms: z.number().int().min(0).max(COBATCH_LIMITS.waitMs).default(0),
      })
      .strict()
      .optional(),
  })
  .strict();
export type AgentSpec = z.infer<typeof AgentSpec>;

export const Preset = z
  .object({
    name: z.string().min(1),
    description: z.string().optional(),
    redis: z
      .object({
        /** Start a local redis-server when nothing answers at `url`. @defaultValue true */
        embedded: z.boolean().default(true),
        url: z.string().url().default('redis://127.0.0.1:6379'),
        /** Key prefix of this deployment. @defaultValue `tb` */
        prefix: z.string().regex(/^[a-zA-Z0-9_-]+$/).default('tb'),
      })
      .strict()
      .default({ embedded: true, url: 'redis://127.0.0.1:6379', prefix: 'tb' }),
    api: z
      .object({
        node: z.string().default('local'),
        host: z.string().default('127.0.0.1'),
        port: z.number().int().min(0).max(65535).default(8000),
        keys: z.array(z.string().min(1)).min(1).default(['tml-local']),
      })
      .strict()
      .default({ node: 'local', host: '127.0.0.1', port: 8000, keys: ['tml-local'] }),
    storage: z
      .object({
        /** Checkpoint directory; shared storage when agents run on several nodes. */
        dir: z.string().default('var/storage'),
        /** How long finished futures, sessions and unnamed sampler weights are kept. @defaultValue 24 */
        retention_hours: z.number().positive().default(24),
      })
      .strict()
      .default({ dir: 'var/storage', retention_hours: 24 }),
    models: z.array(ModelSpec).min(1),
    agents: z.array(AgentSpec).min(1),
  })
  .strict()
  .superRefine((p, ctx) => {
    const names = new Map<string, number>();
    p.models.forEach((m, i) => {
      if (names.has(m.name)) ctx.addIssue({ code: 'custom', path: ['models', i, 'name'], message: `duplicate model name '${m.name}'` });
      names.set(m.name, i);
    });
    const served = new Set<string>();
    const ids = new Set<string>();
    const gpusByNode = new Map<string, Map<number, number[]>>();
    p.agents.forEach((a, i) => {
      if (ids.has(a.id)) ctx.addIssue({ code: 'custom', path: ['agents', i, 'id'], message: `duplicate agent id '${a.id}'` });
      ids.add(a.id);
      a.models.forEach((n, j) => {
        if (!names.has(n))
          ctx.addIssue({ code: 'custom', path: ['agents', i, 'models', j], message: `unknown model '${n}'; models: ${[...names.keys()].join(', ')}` });
        served.add(n);
      });
      const engines = new Set(a.models.map((n) => p.models[names.get(n) ?? -1]?.engine).filter(Boolean));
      if (engines.size > 1) ctx.addIssue({ code: 'custom', path: ['agents', i, 'models'], message: `one agent runs one engine; got ${[...engines].join(' and ')}` });
      const m = /^cuda(?::([\d,]+))?$/.exec(a.device);
      if (m) {
        const used = gpusByNode.get(a.node) ?? new Map<number, number[]>();
        for (const g of (m[1] ?? '0').split(',').map(Number)) used.set(g, [...(used.get(g) ?? []), i]);
        gpusByNode.set(a.node, used);
      } else if (a.gpu_memory !== undefined) ctx.addIssue({ code: 'custom', path: ['agents', i, 'gpu_memory'], message: `gpu_memory applies to an agent on GPUs; agent '${a.id}' runs on ${a.device}` });
      if (a.sleep_level !== undefined) {
        const def = engines.size === 1 ? findEngine([...engines][0]!) : undefined;
        if (!a.take_turns) ctx.addIssue({ code: 'custom', path: ['agents', i, 'sleep_level'], message: `sleep_level applies to an agent that takes turns (take_turns: true)` });
        else if (def && !def.capabilities.sleeps)
          ctx.addIssue({ code: 'custom', path: ['agents', i, 'sleep_level'], message: `sleep_level applies to ${kindsWith((c) => !!c.sleeps).map((k) => `engine '${k}'`).join(' or ')} (its sleep mode), not engine '${def.kind}'` });
      }
      if (a.cobatch) {
        const def = engines.size === 1 ? findEngine([...engines][0]!) : undefined;
        if (def && !def.capabilities.cobatches)
          ctx.addIssue({ code: 'custom', path: ['agents', i, 'cobatch'], message: `cobatch applies to ${kindsWith((c) => !!c.cobatches).map((k) => `engine '${k}'`).join(' or ')}, not engine '${def.kind}'` });
      }
      if (a.take_turns) {
        const def = engines.size === 1 ? findEngine([...engines][0]!) : undefined;
        if (def && !def.capabilities.sharesGpu) ctx.addIssue({ code: 'custom', path: ['agents', i, 'take_turns'], message: `engine '${def.kind}' does not take turns on a GPU in this version (${kindsWith((c) => !!c.sharesGpu).join(' and ')} do)` });
        if (m && deviceGpus(a.device).length !== 1) ctx.addIssue({ code: 'custom', path: ['agents', i, 'take_turns'], message: `take_turns applies to an agent on one GPU; agent '${a.id}' has ${a.device}` });
      }
    });
    // A GPU several agents share: each says its share; they take turns, all of them, or their shares fit together.
    for (const [node, used] of gpusByNode)
      for (const [g, members] of used) {
        if (members.length < 2) continue;
        const agents = members.map((i) => p.agents[i]!);
        const names = agents.map((a) => `'${a.id}'`).join(', ');
        const unset = members.filter((i) => p.agents[i]!.gpu_memory === undefined);
        for (const i of unset) ctx.addIssue({ code: 'custom', path: ['agents', i, 'device'], message: `GPU ${g} of node '${node}' is shared by agents ${names}: set gpu_memory on each of them (the share of the GPU it may use), and take_turns to hand the GPU over by phase` });
        if (unset.length) continue;
        const turns = agents.filter((a) => a.take_turns).length;
        if (turns !== 0 && turns !== agents.length) {
          for (const i of members.filter((i) => !p.agents[i]!.take_turns)) ctx.addIssue({ code: 'custom', path: ['agents', i, 'take_turns'], message: `GPU ${g} of node '${node}' is shared by agents ${names}: either all of them take turns or none` });
          continue;
        }
        const sum = agents.reduce((t, a) => t + a.gpu_memory!, 0);
        if (turns === 0 && sum > 1 + 1e-9)
          ctx.addIssue({ code: 'custom', path: ['agents', members[members.length - 1]!, 'gpu_memory'], message: `GPU ${g} of node '${node}': the gpu_memory of agents ${names} add up to ${Number(sum.toFixed(4))}, more than the GPU; lower them, or set take_turns on each so that they use it by turns` });
      }
    p.models.forEach((m, i) => {
      if (!served.has(m.name)) ctx.addIssue({ code: 'custom', path: ['models', i, 'name'], message: `model '${m.name}' is served by no agent` });
      const gpus = p.agents.filter((a) => a.models.includes(m.name)).map((a) => ({ id: a.id, device: a.device, n: deviceGpus(a.device).length }));
      for (const [field, message] of parallelismProblems(m, gpus)) ctx.addIssue({ code: 'custom', path: ['models', i, ...field], message });
    });
  });
export type Preset = z.infer<typeof Preset>;

/**
 * The fields of a model that only some engines use, refused where they would be ignored: each
 * engine registers those it uses (`modelOptions`) and its own rules for them (`presetProblems`);
 * `.pipeline` no engine uses. `agents`: the GPUs of each agent serving the model.
 */
function parallelismProblems(m: ModelSpec, agents: { id: string; device: string; n: number }[]): PresetProblem[] {
  const out: PresetProblem[] = [];
  const par = m.parallelism;
  const def = findEngine(m.engine);
  if (!def) return out; // the engine field's own issue says so
  const uses = (o: ModelOption) => def.capabilities.modelOptions.includes(o);
  const users = (o: ModelOption) => kindsWith((c) => c.modelOptions.includes(o));
  const owners = (o: ModelOption) => users(o).map((k) => `engine '${k}'`).join(' or ');
  const engine = `engine '${m.engine}'`;
  if (par.pipeline !== 1) out.push([['parallelism', 'pipeline'], `pipeline parallelism is not available in this version (${users('tensor').join(' and ')} splits a model with tensor, ${users('data').join(' and ')} with data)`]);
  if (!uses('tensor') && par.tensor !== 1) out.push([['parallelism', 'tensor'], `tensor parallelism applies to ${owners('tensor')}; ${engine} ${def.capabilities.placement}`]);
  if (!uses('expert') && par.expert !== 1) out.push([['parallelism', 'expert'], `expert parallelism applies to ${owners('expert')}, not ${engine}`]);
  if (!uses('data') && par.data !== undefined && par.data !== 1) out.push([['parallelism', 'data'], `data parallelism applies to ${owners('data')}, not ${engine}`]);
  if (!uses('strategy') && par.strategy !== undefined) out.push([['parallelism', 'strategy'], `strategy applies to ${owners('strategy')}, not ${engine}`]);
  if (!uses('offload') && m.offload) out.push([['offload'], `offload applies to ${owners('offload')}, not ${engine}`]);
  for (const o of ['remove_padding', 'gradient_checkpointing'] as const)
    if (!uses(o) && m[o] !== undefined) out.push([[o], `${o} applies to ${owners(o)}, not ${engine}`]);
  if (!uses('load_format') && m.load_format !== undefined) out.push([['load_format'], `load_format applies to ${owners('load_format')}, not ${engine}`]);
  out.push(...(def.presetProblems?.(m, agents) ?? []));
  return out;
}

export class PresetError extends Error {
  override readonly name = 'PresetError';
}

/** Reads and validates a preset file; every problem is reported with its field path. */
export function loadPreset(file: string): { preset: Preset; dir: string } {
  let raw: unknown;
  try {
    raw = YAML.parse(readFileSync(file, 'utf8'));
  } catch (e) {
    throw new PresetError(`cannot read preset ${file}: ${(e as Error).message}`);
  }
  const res = Preset.safeParse(raw);
  if (!res.success) {
    const lines = res.error.issues.map((i) => `  ${i.path.map((p) => (typeof p === 'number' ? `[${p}]` : `.${String(p)}`)).join('').replace(/^\./, '') || '(top level)'}: ${i.message}`);
    throw new PresetError(`invalid preset ${file}:\n${lines.join('\n')}`);
  }
  return { preset: res.data, dir: path.dirname(path.resolve(file)) };
}
