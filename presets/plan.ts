import { existsSync } from 'node:fs';
import path from 'node:path';
import { deviceGpus, loadAgentConfig, loadApiConfig, loadCommonConfig, type AgentConfig, type ApiConfig, type BaseModelSpec, type EnvDefaults } from '../queues/infra/config.js';
import { engineCatalogue, engineOf, kindsWith } from '../workers/adapters/index.js';
import type { Engine, ModelRole, Preset } from './schema.js';

/**
 * A preset resolved for one node: where Redis is (and whether to start it), the API's
 * configuration if the API runs on this node, and the configuration of each agent placed here.
 * `start --dry-run` prints it.
 */
export type Plan = {
  preset: string;
  node: string;
  redis: { url: string; embedded: boolean; prefix: string };
  api: ApiConfig | null;
  agents: (AgentConfig & { engine: Engine; device: string; roles: Record<string, ModelRole[]> })[];
  /** Every model of the preset: name → resolved path, role, engine. */
  models: { name: string; path: string; tokenizer: string; role: ModelRole; engine: Engine; served_by: string[] }[];
  /** Every agent of the preset, on every node; `here`: started by this command. */
  layout: { id: string; node: string; device: string; engine: Engine; models: string[]; here: boolean; /** Its share of the GPU (`gpu_memory`) and whether it takes turns, or `-`. */ gpu: string }[];
  /** Storage directory and how long futures and unnamed sampler weights are kept. */
  storage: { dir: string; retentionS: number };
};

export type PlanOptions = {
  node?: string;
  /** Only these agents (by id), e.g. one compose service per GPU. */
  agentIds?: string[];
  apiOnly?: boolean;
  agentsOnly?: boolean;
  python: string;
  /** The environment: every variable of queues/infra/config.ts overrides the preset (TB_AGENT_ID, TB_ENGINE_DEVICE, TB_VLLM_URL and TB_AGENT_MODELS only in a plan of one agent). */
  env?: NodeJS.ProcessEnv;
};

/** A model path relative to the preset's directory when it exists there, else to the working directory; hub ids stay as they are. */
function resolveModelPath(p: string, presetDir: string): string {
  if (path.isAbsolute(p)) return p;
  const fromPreset = path.resolve(presetDir, p);
  if (existsSync(fromPreset)) return fromPreset;
  const fromCwd = path.resolve(p);
  if (existsSync(fromCwd) || p.startsWith('.') || p.startsWith('models/')) return fromCwd;
  return p;
}

/** Agent settings only a plan of exactly one agent takes from the environment. */
const ONE_AGENT_ONLY = ['TB_AGENT_ID', 'TB_ENGINE_DEVICE', 'TB_VLLM_URL', 'TB_AGENT_MODELS'];

export function planPreset(preset: Preset, presetDir: string, name: string, opts: PlanOptions): Plan {
  const env = opts.env ?? {};
  const node = opts.node ?? preset.api.node;
  // The preset's values come in as the variables that override them (queues/infra/config.ts parses both).
  const presetEnv: EnvDefaults = {
    REDIS_URL: preset.redis.url,
    TB_PREFIX: preset.redis.prefix,
    TB_STORAGE_DIR: preset.storage.dir,
    TB_FUTURE_RETENTION_S: String(Math.round(preset.storage.retention_hours * 3600)),
  };
  const { redisUrl, prefix, storageDir, retentionS } = loadCommonConfig(env, presetEnv);
  const models = preset.models.map((m) => ({ ...m, path: resolveModelPath(m.path, presetDir) }));
  const byName = new Map(models.map((m) => [m.name, m]));

  const chosen = preset.agents.filter((a) => (opts.agentIds?.length ? opts.agentIds.includes(a.id) : a.node === node));
  if (opts.agentIds) for (const id of opts.agentIds) if (!preset.agents.some((a) => a.id === id)) throw new Error(`preset ${name} has no agent '${id}'`);
  const agentEnv = chosen.length === 1 ? env : Object.fromEntries(Object.entries(env).filter(([k]) => !ONE_AGENT_ONLY.includes(k)));
  const agents = opts.apiOnly
    ? []
    : chosen.map((a) => {
        // Models of one path are loaded once: their names become aliases, their roles merge.
        const byPath = new Map<string, BaseModelSpec & { roles: ModelRole[] }>();
        for (const n of a.models) {
          const m = byName.get(n)!;
          const e = byPath.get(m.path) ?? {
            name: m.path,
            path: m.path,
            tokenizer: m.tokenizer ?? m.path,
            aliases: [],
            trainable: false,
            loraMaxRank: m.lora_max_rank,
            topkMax: m.topk_max,
            dtype: m.dtype,
            tensorParallel: m.parallelism.tensor,
            ...(m.parallelism.expert > 1 ? { expertParallel: true } : {}),
            // The fields only some engines use (presets/schema.ts refuses them on the others).
            ...(engineOf(m.engine).capabilities.modelOptions.includes('strategy') ? { strategy: m.parallelism.strategy } : {}),
            ...(engineOf(m.engine).capabilities.modelOptions.includes('data') && m.parallelism.data !== undefined ? { dataParallel: m.parallelism.data } : {}),
            ...(engineOf(m.engine).capabilities.modelOptions.includes('offload') ? { offload: m.offload } : {}),
            ...(m.remove_padding !== undefined ? { removePadding: m.remove_padding } : {}),
            ...(m.gradient_checkpointing !== undefined ? { gradientCheckpointing: m.gradient_checkpointing } : {}),
            ...(m.load_format ? { loadFormat: m.load_format } : {}),
            roles: [],
          };
          e.aliases.push(m.name);
          e.roles.push(m.role);
          e.trainable ||= m.role === 'actor';
          e.loraMaxRank = Math.max(e.loraMaxRank, m.lora_max_rank);
          e.topkMax = Math.max(e.topkMax, m.topk_max);
          e.tensorParallel = Math.max(e.tensorParallel ?? 1, m.parallelism.tensor);
          byPath.set(m.path, e);
        }
        const specs = [...byPath.values()];
        // The engine of the agent's models (the schema allows one engine per agent): the agent picks its adapter by it.
        const engine = byName.get(a.models[0]!)!.engine;
        const config = loadAgentConfig(agentEnv, {
          defaults: {
            ...presetEnv,
            TB_AGENT_ID: a.id,
            TB_ENGINE_DEVICE: a.device,
            TB_SAMPLE_CONCURRENCY: String(a.sample_concurrency),
            ...(a.gpu_memory === undefined ? {} : { TB_GPU_MEMORY: String(a.gpu_memory) }),
            ...(a.take_turns ? { TB_GPU_TURNS: turnKey(a.node, a.device) } : {}),
            ...(a.sleep_level === undefined ? {} : { TB_VLLM_SLEEP_LEVEL: String(a.sleep_level) }),
            ...(a.cobatch ? { TB_COBATCH_MAX: String(a.cobatch.max), TB_COBATCH_WAIT_MS: String(a.cobatch.wait_ms) } : {}),
            TB_ENGINE: engine,
            TB_PYTHON: opts.python,
          },
          models: specs.map(({ roles: _roles, ...s }) => s),
        }, engineCatalogue());
        return { ...config, engine, device: a.device, roles: Object.fromEntries(specs.map((s) => [s.aliases.join('|'), s.roles])) };
      });

  // The API waits for the preset's models, or for those a one-agent plan serves instead (TB_AGENT_MODELS).
  const served = env.TB_AGENT_MODELS && agents.length === 1 ? agents[0]!.models.map((m) => m.aliases[0] ?? m.name) : preset.models.map((m) => m.name);
  const api: ApiConfig | null =
    opts.agentsOnly || preset.api.node !== node
      ? null
      : loadApiConfig(env, {
          ...presetEnv,
          TB_HOST: preset.api.host,
          TB_PORT: String(preset.api.port),
          TB_API_KEYS: preset.api.keys.join(','),
          TB_REQUIRED_MODELS: served.join(','),
        });

  return {
    preset: name,
    node,
    redis: { url: redisUrl, embedded: preset.redis.embedded, prefix },
    api,
    agents,
    models: models.map((m) => ({
      name: m.name,
      path: m.path,
      tokenizer: m.tokenizer ?? m.path,
      role: m.role,
      engine: m.engine,
      served_by: preset.agents.filter((a) => a.models.includes(m.name)).map((a) => `${a.id}@${a.node}(${a.device})`),
    })),
    layout: preset.agents.map((a) => ({
      id: a.id,
      node: a.node,
      device: a.device,
      engine: byName.get(a.models[0]!)!.engine,
      models: a.models,
      here: !opts.apiOnly && chosen.includes(a),
      gpu: [a.gpu_memory, a.take_turns ? 'turns' : undefined].filter((x) => x !== undefined).join(', ') || '-',
    })),
    storage: { dir: storageDir, retentionS },
  };
}

/**
 * What `start` would refuse in a plan, one plain line each with the fix: verl agents off the GPUs, vLLM agents
 * asked to train, model directories that do not exist (`generated(path)`: directories start
 * creates itself, such as the tiny model).
 */
export function planProblems(p: Plan, generated: (modelPath: string) => boolean = () => false): string[] {
  const out: string[] = [];
  if (p.agents.length === 0 && !p.api) out.push(`nothing to start on node '${p.node}' (no API and no agent placed there); pass --node with a node of the preset`);
  for (const a of p.agents) {
    const device = a.engineDevice ?? a.device;
    const { capabilities } = engineOf(a.engine);
    // A verl agent on `cpu` runs CPU ranks when its models set parallelism.data (workers/adapters/verl.ts).
    if (capabilities.gpuOnly && deviceGpus(device).length === 0 && !a.models.some((m) => m.dataParallel !== undefined))
      out.push(`agent ${a.agentId}: engine '${a.engine}' runs on GPUs; its device is '${device}' (use cuda, cuda:N or cuda:N,M,…)`);
    if (!capabilities.trains) {
      const trainable = a.models.filter((m) => m.trainable);
      if (trainable.length)
        out.push(`agent ${a.agentId}: engine '${a.engine}' samples only, but model ${trainable.map((m) => m.aliases.join('|') || m.name).join(', ')} has role actor; train it on an agent of an engine that trains (${kindsWith((c) => c.trains).join(', ')})`);
    }
    for (const m of a.models)
      if (!generated(m.path) && !existsSync(path.join(m.path, 'config.json')))
        out.push(`agent ${a.agentId}: model ${m.aliases.join('|') || m.name} has no model directory at ${m.path} (no config.json); download it there or fix its path in the preset`);
  }
  return out;
}


function pad(rows: string[][]): string {
  const widths = rows[0]!.map((_, i) => Math.max(...rows.map((r) => (r[i] ?? '').length)));
  return rows.map((r) => '  ' + r.map((c, i) => (i === r.length - 1 ? c : c.padEnd(widths[i]!))).join('  ').trimEnd()).join('\n');
}

/** `start --dry-run`: the plan as tables, API keys left out, then the problems start would refuse. */
export function formatPlan(p: Plan & { notes?: string[] | undefined }, problems: string[]): string {
  const lines: string[] = [];
  lines.push(`preset   ${p.preset}`);
  lines.push(`node     ${p.node} (start --node NAME picks another node of the preset)`);
  lines.push(`redis    ${p.redis.url} prefix '${p.redis.prefix}'${p.redis.embedded ? ' (started here when nothing answers and the URL is local)' : ' (external)'}`);
  lines.push(
    p.api
      ? `api      http://${p.api.host}:${p.api.port}/api/v1 (${p.api.apiKeys.length} API key${p.api.apiKeys.length === 1 ? '' : 's'}, not shown)`
      : 'api      not on this node',
  );
  lines.push(`storage  ${p.storage.dir} (futures and unnamed sampler weights kept ${+(p.storage.retentionS / 3600).toFixed(2)} h)`);
  lines.push('', 'agents:');
  const roleOf = new Map(p.models.map((m) => [m.name, m.role]));
  lines.push(
    pad([
      ['AGENT', 'NODE', 'DEVICE', 'GPUS', 'GPU SHARE', 'ENGINE', 'STARTS HERE', 'MODELS (ROLE)'],
      ...p.layout.map((a) => [
        a.id,
        a.node,
        a.device,
        String(deviceGpus(a.device).length || '-'),
        a.gpu,
        a.engine,
        a.here ? 'yes' : 'no',
        a.models.map((m) => `${m} (${roleOf.get(m) ?? '?'})`).join(', '),
      ]),
    ]),
  );
  lines.push('', 'models:');
  lines.push(
    pad([
      ['MODEL', 'ROLE', 'ENGINE', 'DIRECTORY', 'SERVED BY'],
      ...p.models.map((m) => [m.name, m.role, m.engine, `${m.path}${existsSync(path.join(m.path, 'config.json')) ? '' : ' (missing)'}`, m.served_by.join(', ')]),
    ]),
  );
  const nodes = [...new Set(p.layout.map((a) => a.node))];
  if (nodes.length > 1) lines.push('', `nodes: ${nodes.join(', ')}; run 'tinker-broker start --preset ${p.preset} --node NAME' on each (the API runs on '${p.api ? p.node : 'its node'}')`);
  // `start --cpu-standin` (presets/standin.ts): what the stand-in could not keep.
  if (p.notes) lines.push('', `cpu stand-in of the preset: tiny models, CPU devices, local Redis and storage${p.notes.length ? '; changed beyond that:' : ''}`, ...p.notes.map((x) => `  - ${x}`));
  if (problems.length) lines.push('', 'start would refuse this plan:', ...problems.map((x) => `  ! ${x}`));
  else lines.push('', 'start would accept this plan.');
  return lines.join('\n');
}

/**
 * The GPU-turn key of an agent taking turns (workers/gpu-turns.ts): its node and GPU, `<node>/<index>`
 * (`<node>/cpu` on the CPU), the same for every agent of the node on that device.
 */
export function turnKey(node: string, device: string): string {
  if (device === 'cpu') return `${node}/cpu`;
  const gpus = deviceGpus(device);
  return `${node}/${gpus[0] ?? 0}`;
}
