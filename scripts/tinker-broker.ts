import type { ChildProcess } from 'node:child_process';
import { existsSync } from 'node:fs';
import path from 'node:path';
import { parseArgs } from 'node:util';
import { assertSafeKeys, startApi, StartRefused } from '../api/main.js';
import { parseModelSpec } from '../queues/config.js';
import { logger } from '../queues/logger.js';
import { loadPreset, PresetError } from '../presets/schema.js';
import { planPreset, type Plan } from '../presets/plan.js';
import { Agent } from '../workers/agent.js';
import { defaultPython, ensureRedis, ensureTinyModel, TINY_MODEL_DIR } from './stack.js';

/**
 * The command line: `tinker-broker start [--preset FILE] [--node NAME] [--agent ID]… [--api-only]
 * [--agents-only] [--dry-run]` and `tinker-broker validate FILE…`. With no preset, the embedded
 * default presets/cpu/tiny.yaml. Environment variables (REDIS_URL, TB_PREFIX, TB_HOST, TB_PORT,
 * TB_API_KEYS, TB_STORAGE_DIR, TB_LONG_POLL_MS, TB_AGENT_ID, TB_AGENT_MODELS, TB_VLLM_URL) override the preset.
 */
export const DEFAULT_PRESET = 'presets/cpu/tiny.yaml';

const USAGE = `usage:
  tinker-broker start [--preset FILE] [--node NAME] [--agent ID]... [--api-only | --agents-only] [--dry-run]
  tinker-broker validate FILE...
  tinker-broker drain [--agent ID]... [--timeout-s N]`;

function plan(argv: string[]): Plan {
  const { values } = parseArgs({
    args: argv,
    options: {
      preset: { type: 'string', default: DEFAULT_PRESET },
      node: { type: 'string' },
      agent: { type: 'string', multiple: true },
      'api-only': { type: 'boolean', default: false },
      'agents-only': { type: 'boolean', default: false },
      'dry-run': { type: 'boolean', default: false },
    },
  });
  const { preset, dir } = loadPreset(values.preset!);
  const p = planPreset(preset, dir, values.preset!, {
    node: values.node,
    agentIds: values.agent,
    apiOnly: values['api-only'],
    agentsOnly: values['agents-only'],
    python: process.env.TB_PYTHON ?? defaultPython(),
    env: process.env,
  });
  // A one-agent plan may have its models replaced from the environment (tests, quick experiments).
  if (process.env.TB_AGENT_MODELS && p.agents.length === 1) {
    const samplingOnly = p.agents[0]!.engine === 'vllm';
    const specs = process.env.TB_AGENT_MODELS.split(',').map((s) => ({ ...parseModelSpec(s.trim()), ...(samplingOnly ? { trainable: false } : {}) }));
    p.agents[0]!.models = specs;
    if (p.api) p.api.requiredModels = specs.map((m) => m.aliases[0] ?? m.name);
  }
  return p;
}

async function start(argv: string[]): Promise<void> {
  const dryRun = argv.includes('--dry-run');
  const p = plan(argv);
  if (dryRun) {
    process.stdout.write(`${JSON.stringify(p, null, 2)}\n`);
    return;
  }
  if (p.agents.length === 0 && !p.api) throw new Error(`nothing to start on node '${p.node}' (no API and no agent placed there)`);
  for (const a of p.agents) {
    if (a.engine === 'verl')
      throw new Error(`agent ${a.agentId}: engine 'verl' is not available in this version; use engine: torch (see README, Engines)`);
    if (a.engine === 'vllm') {
      const trainable = a.models.filter((m) => m.trainable);
      if (trainable.length)
        throw new Error(`agent ${a.agentId}: engine 'vllm' samples only; model ${trainable.map((m) => m.aliases.join('|') || m.name).join(', ')} has role actor (train it on a torch agent)`);
    }
    for (const m of a.models) {
      if (m.path === TINY_MODEL_DIR || m.path.startsWith(`${TINY_MODEL_DIR}-`)) ensureTinyModel(a.python, m.path, m.path === TINY_MODEL_DIR ? 0 : 1);
      else if (!existsSync(path.join(m.path, 'config.json')))
        throw new Error(`agent ${a.agentId}: model ${m.aliases.join('|') || m.name} has no model directory at ${m.path}`);
    }
  }
  if (p.api) assertSafeKeys(p.api, process.env);
  let redis: ChildProcess | null = null;
  if (p.redis.embedded && (p.api || p.agents.length)) redis = await ensureRedis(p.redis.url);

  const agents = p.agents.map((a) => new Agent(a));
  const api = p.api ? await startApi({ config: p.api }) : null;
  let stopping = false;
  const shutdown = async (sig: string) => {
    if (stopping) return;
    stopping = true;
    logger.info('stopping', { signal: sig });
    // No forced exit here: agents drain (finish the op in flight, save every model) within the
    // operator's stop grace (compose stop_grace_period); a second signal exits at once.
    process.once('SIGTERM', () => process.exit(1));
    process.once('SIGINT', () => process.exit(1));
    await api?.stop().catch(() => undefined);
    await Promise.all(agents.map((a) => a.drain().catch(() => undefined)));
    redis?.kill('SIGTERM');
    process.exit(process.exitCode ?? 0);
  };
  process.on('SIGTERM', () => void shutdown('SIGTERM'));
  process.on('SIGINT', () => void shutdown('SIGINT'));
  await Promise.all(agents.map((a) => a.start()));
  // Agents drained through Redis (`tinker-broker drain`) end this process once all of them stopped.
  if (agents.length) void Promise.all(agents.map((a) => a.stopped)).then(() => void shutdown('agents drained'));
  logger.info('tinker-broker ready', {
    preset: p.preset,
    node: p.node,
    ...(api ? { base_url: `http://${p.api!.host}:${api.port}` } : {}),
    agents: p.agents.map((a) => a.agentId),
  });
}

/**
 * `tinker-broker drain [--agent ID]… [--timeout-s N]`: asks running agents (all live ones on
 * REDIS_URL/TB_PREFIX when no --agent) to drain (docs/reliability.md) and waits until each has stopped;
 * prints one JSON line per agent. Exit status 1 when an agent is not live or did not stop in time.
 */
async function drainCommand(argv: string[]): Promise<void> {
  const { values } = parseArgs({ args: argv, options: { agent: { type: 'string', multiple: true }, 'timeout-s': { type: 'string', default: '900' } } });
  const timeoutS = Number(values['timeout-s']);
  if (!Number.isFinite(timeoutS) || timeoutS <= 0) throw new PresetError(`--timeout-s must be a positive number\n${USAGE}`);
  const { drainAgents } = await import('../workers/drain.js');
  const results = await drainAgents(process.env, values.agent ?? [], timeoutS);
  for (const r of results) process.stdout.write(`${JSON.stringify(r)}\n`);
  if (results.length === 0) process.stderr.write('no live agent to drain\n');
  if (results.length === 0 || results.some((r) => r.status !== 'drained')) process.exitCode = 1;
}

async function main(): Promise<void> {
  const [cmd, ...rest] = process.argv.slice(2);
  if (cmd === 'start') return start(rest);
  if (cmd === 'drain') return drainCommand(rest);
  if (cmd === 'validate') {
    if (rest.length === 0) throw new PresetError(USAGE);
    for (const f of rest) {
      loadPreset(f);
      process.stdout.write(`${f}: ok\n`);
    }
    return;
  }
  throw new PresetError(USAGE);
}

main().catch((err) => {
  const plain = err instanceof PresetError || err instanceof StartRefused;
  if (plain) process.stderr.write(`${err.message}\n`);
  else logger.error('tinker-broker failed', { error: String(err?.stack ?? err) });
  process.exit(plain ? 2 : 1);
});
