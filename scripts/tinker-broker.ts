import type { ChildProcess } from 'node:child_process';
import { pathToFileURL } from 'node:url';
import { assertSafeKeys, StartRefused } from '../api/auth.js';
import type { startApi } from '../api/main.js';
import { loadLauncherConfig } from '../queues/infra/config.js';
import { logger } from '../queues/infra/logger.js';
import { loadPreset, PresetError } from '../presets/schema.js';
import { formatPlan, planPreset, planProblems, type Plan } from '../presets/plan.js';
import { cpuStandin } from '../presets/standin.js';
import type { Agent } from '../workers/agent.js';
import { commandUsage, parseCommand, programUsage, UsageError, type Command, type CommandTable, type OptionSpec, type Parsed } from './cli.js';
import { inspectCommands } from './inspect.js';
import { assertPortFree, defaultPython, ensureRedis, ensureTinyModel, stopChild, TINY_MODEL_DIR, TINY_TEACHER_DIR } from './stack.js';

/**
 * The command line, `tinker-broker <command>`: one entry per command in COMMANDS below (options,
 * help text, defaults and overriding environment variables are declared there; `--help` is
 * derived from them). Operator mistakes print one line and exit with code 2; other failures
 * exit with 1.
 */
export const DEFAULT_PRESET = 'presets/cpu/tiny.yaml';
const PROG = 'tinker-broker';

/** `--preset`, shared by the commands that read a preset. */
export const presetOption: OptionSpec = { type: 'string', arg: 'FILE', default: DEFAULT_PRESET, help: 'launch preset (YAML, see presets/README.md)' };

const START_DETAILS = `
Every environment variable of the API and the agents (README, Configuration; queues/infra/config.ts)
overrides the preset and is checked as it is without one; among them:
  REDIS_URL          redis.url            TB_PREFIX         redis.prefix
  TB_HOST            api.host             TB_PORT           api.port
  TB_API_KEYS        api.keys (comma separated)
  TB_ADMIN_KEYS      keys of the /admin dashboard (default: the API key, when there is exactly one)
  TB_STORAGE_DIR     storage.dir          TB_LONG_POLL_MS   longest retrieve_future wait (default 25000)
  TB_FUTURE_RETENTION_S                   storage.retention_hours (in seconds)
  TB_REDIS_DIR       data directory of a Redis started here (default var/redis)
  TB_PYTHON          engine interpreter (default .venv/bin/python, else python3)
  TB_LOG_LEVEL       error|warn|info|debug (default info)
  TB_LOG_FORMAT      json|text (default text; json when NODE_ENV=production)
For a start with exactly one agent: TB_AGENT_ID, TB_AGENT_MODELS (path[=alias],...),
TB_ENGINE_DEVICE, TB_VLLM_URL.

SIGTERM or SIGINT (Ctrl-C) stops the API and drains the agents: the ops in flight finish, every
model is saved and reloaded by their next start (docs/reliability.md); then their engines and a
Redis started here stop. No time limit but the operator's stop grace, unless TB_STOP_GRACE_S is
set; a second signal stops at once.

examples:
  tinker-broker start                                   # tiny CPU model on 127.0.0.1:8000
  tinker-broker start --preset presets/quick_start/actor.yaml --dry-run
  tinker-broker start --preset my.yaml --node gpu-node-2 # the agents of one node
  tinker-broker start --preset presets/distill/single_teacher.yaml --cpu-standin --dry-run`;

/** The preset's plan for this command; with `--cpu-standin`, the preset's CPU stand-in (presets/standin.ts) and its notes. */
function plan(p: Parsed): Plan & { notes?: string[] } {
  const file = p.values.preset as string;
  const loaded = loadPreset(file);
  const { preset, notes } = p.values['cpu-standin']
    ? cpuStandin(loaded.preset, { tinyDir: TINY_MODEL_DIR, teacherDir: TINY_TEACHER_DIR, storageRoot: 'var/standin' })
    : { preset: loaded.preset, notes: undefined };
  const dir = loaded.dir;
  let pl: Plan;
  try {
    pl = planPreset(preset, dir, file, {
      node: p.values.node as string | undefined,
      agentIds: p.values.agent as string[] | undefined,
      apiOnly: p.values['api-only'] === true,
      agentsOnly: p.values['agents-only'] === true,
      python: process.env.TB_PYTHON ?? defaultPython(),
      env: process.env,
    });
  } catch (e) {
    throw new UsageError((e as Error).message);
  }
  return notes ? { ...pl, notes } : pl;
}

/** Model directories that start generates itself (the tiny test models). */
const generated = (p: string) => p === TINY_MODEL_DIR || p.startsWith(`${TINY_MODEL_DIR}-`);

/**
 * Under `npx tinker-broker` (and `npm start` in npm versions that keep a shell) npm forwards
 * SIGTERM to the `sh -c` it ran, which dies without passing it on: this process would be left
 * running. So when npm started us, the end of our parent is a stop signal too.
 */
function watchNpmParent(stop: () => void): void {
  if (!process.env.npm_command) return;
  const parent = process.ppid;
  const t = setInterval(() => {
    try {
      process.kill(parent, 0);
    } catch {
      clearInterval(t);
      stop();
    }
  }, 500);
  t.unref();
}

/** Set once a stop signal arrived: a failure of a half-started piece is then part of stopping. */
let stopping = false;

async function start(p: Parsed): Promise<void> {
  const pl = plan(p);
  let launcher: ReturnType<typeof loadLauncherConfig>;
  try {
    launcher = loadLauncherConfig(process.env);
  } catch (e) {
    throw new UsageError((e as Error).message);
  }
  const problems = planProblems(pl, generated);
  if (pl.api)
    try {
      assertSafeKeys(pl.api, process.env);
    } catch (e) {
      problems.push((e as Error).message);
    }
  if (p.values['dry-run']) {
    if (p.values.json) {
      const { api, ...rest } = pl;
      process.stdout.write(`${JSON.stringify({ ...rest, api: api && { ...api, apiKeys: `(${api.apiKeys.length} hidden)` }, problems }, null, 2)}\n`);
    } else process.stdout.write(`${formatPlan(pl, problems)}\n`);
    return;
  }
  for (const n of pl.notes ?? []) process.stderr.write(`cpu-standin: ${n}\n`);
  if (problems.length) throw new UsageError(problems.join('\n'));
  if (pl.api) await assertPortFree(pl.api.host, pl.api.port);

  // Everything started so far, stopped in reverse on a signal or when starting fails.
  let redis: ChildProcess | null = null;
  let api: Awaited<ReturnType<typeof startApi>> | null = null;
  const agents: Agent[] = [];
  const cleanup = async (drain = false) => {
    await api?.stop().catch((e) => logger.warn('api stop failed', { error: String(e) }));
    await Promise.all(agents.map((a) => (drain ? a.drain() : a.stop()).catch((e) => logger.warn('agent stop failed', { agentId: a.config.agentId, error: String(e) }))));
    if (redis) await stopChild(redis, 10_000);
  };
  let signals = 0;
  const shutdown = async (sig: string) => {
    signals += 1;
    if (signals > 1) {
      logger.warn('second signal: stopping at once', { signal: sig });
      redis?.kill('SIGKILL');
      process.exit(1);
    }
    stopping = true;
    // Agents finish the ops in flight and save every model (a forward_backward on a GPU may take
    // minutes): no forced exit but the operator's stop grace, unless TB_STOP_GRACE_S is set.
    const graceS = launcher.stopGraceS ?? null;
    logger.info('stopping', { signal: sig, ...(agents.length ? { note: 'agents drain: running jobs finish and models are saved first; signal again to stop at once' } : {}) });
    if (graceS !== null) {
      const force = setTimeout(() => {
        logger.error(`shutdown took longer than ${graceS} s (TB_STOP_GRACE_S); exiting`);
        redis?.kill('SIGKILL');
        process.exit(1);
      }, graceS * 1000);
      force.unref();
    }
    await cleanup(true);
    logger.info('stopped');
    process.exit(process.exitCode ?? 0);
  };
  process.on('SIGTERM', () => void shutdown('SIGTERM'));
  process.on('SIGINT', () => void shutdown('SIGINT'));
  process.on('SIGHUP', () => void shutdown('SIGHUP'));
  watchNpmParent(() => void shutdown('parent exited'));

  try {
    for (const a of pl.agents) for (const m of a.models) if (generated(m.path)) ensureTinyModel(a.python, m.path, m.path === TINY_MODEL_DIR ? 0 : 1);
    if (pl.redis.embedded && (pl.api || pl.agents.length)) redis = await ensureRedis(pl.redis.url, launcher.redisDir);
    if (stopping) return;
    // A node loads only what it runs: the API's modules when it serves the API, the agent's when it runs agents (the engines' adapter registry is light and comes with presets/).
    if (pl.agents.length) {
      const { Agent } = await import('../workers/agent.js');
      for (const a of pl.agents) agents.push(new Agent(a));
    }
    // /healthz waits for this node's own agents: a dead predecessor's may still look live in Redis.
    let agentsReady = agents.length === 0;
    api = pl.api ? await (await import('../api/main.js')).startApi({ config: pl.api }, { localAgentsReady: () => agentsReady }) : null;
    await Promise.all(agents.map((a) => a.start()));
    agentsReady = true;
    // Agents drained through Redis (`tinker-broker drain`) end this process once all of them stopped.
    if (agents.length) void Promise.all(agents.map((a) => a.stopped)).then(() => (stopping ? undefined : void shutdown('agents drained')));
  } catch (e) {
    if (stopping) return; // a piece failed because a signal stopped it; shutdown() ends the process
    stopping = true;
    await cleanup();
    throw e;
  }
  if (stopping) return;
  logger.info('tinker-broker ready', {
    preset: pl.preset,
    node: pl.node,
    ...(api ? { base_url: `http://${pl.api!.host}:${api.port}` } : {}),
    agents: pl.agents.map((a) => a.agentId),
  });
}

/**
 * `tinker-broker drain`: asks running agents (all live ones on REDIS_URL/TB_PREFIX without --agent)
 * to drain (docs/reliability.md) and waits until each has stopped; one JSON line per agent; exit
 * status 1 when an agent is not live or did not stop in time.
 */
async function drainCommand(p: Parsed): Promise<void> {
  const timeoutS = Number(p.values['timeout-s']);
  if (!Number.isFinite(timeoutS) || timeoutS <= 0) throw new UsageError(`--timeout-s must be a positive number, got '${p.values['timeout-s']}'`);
  const { drainAgents } = await import('../workers/drain.js');
  const results = await drainAgents(process.env, (p.values.agent as string[] | undefined) ?? [], timeoutS);
  for (const r of results) process.stdout.write(`${JSON.stringify(r)}\n`);
  if (results.length === 0) process.stderr.write('no live agent to drain\n');
  if (results.length === 0 || results.some((r) => r.status !== 'drained')) process.exitCode = 1;
}

const drainCommandSpec: Command = {
  summary: 'drain running agents: finish their ops in flight, save every model for their next start, stop',
  options: {
    agent: { type: 'string', arg: 'ID', multiple: true, help: 'drain this agent (default: every live agent of REDIS_URL / TB_PREFIX)' },
    'timeout-s': { type: 'string', arg: 'N', default: '900', help: 'give up waiting after N seconds' },
  },
  details: `
Prints one JSON line per agent: {"agent_id", "status": "drained"|"not_live"|"timeout", "models_saved", "seconds"}.
The agents' processes exit 0; their next start (same agent id) reloads the saved models.`,
  run: drainCommand,
};

async function validate(p: Parsed): Promise<void> {
  for (const f of p.positionals) {
    loadPreset(f);
    process.stdout.write(`${f}: ok\n`);
  }
}

/** The commands. To add one, add an entry (see scripts/cli.ts, Command). */
export const COMMANDS: CommandTable = {
  start: {
    summary: 'start the API, the worker agents and Redis of a preset on this node',
    options: {
      preset: presetOption,
      node: { type: 'string', arg: 'NAME', help: "start the API and agents placed on this node of the preset (default: the API's node)" },
      agent: { type: 'string', arg: 'ID', multiple: true, help: 'start only this agent of the preset (any node), e.g. one per GPU container' },
      'api-only': { type: 'boolean', help: 'start the API only, no agent' },
      'agents-only': { type: 'boolean', help: 'start the agents only, no API' },
      'cpu-standin': { type: 'boolean', help: 'run the preset on this CPU: tiny models, CPU devices, local Redis and storage; names, roles, agents and nodes kept (presets/README.md)' },
      'dry-run': { type: 'boolean', help: 'print what would start (agents, GPUs, models, engines, roles) and what start would refuse; start nothing' },
      json: { type: 'boolean', help: 'with --dry-run: the plan as JSON (API keys hidden)' },
    },
    details: START_DETAILS,
    run: start,
  },
  validate: {
    summary: 'check preset files against the schema',
    args: 'FILE...',
    minArgs: 1,
    maxArgs: Infinity,
    options: {},
    run: validate,
  },
  ...inspectCommands,
  drain: drainCommandSpec,
};

const INTRO = `A Tinker-compatible training and sampling server: the API, BullMQ queues in Redis, and worker
agents beside PyTorch (or vLLM) engines. 'start' runs a preset; the other commands read the
state of a running deployment from its Redis.`;

export async function main(argv: string[], table: CommandTable = COMMANDS): Promise<void> {
  const [name, ...rest] = argv;
  if (name === undefined || name === '--help' || name === '-h' || name === 'help') {
    const sub = name === 'help' ? rest[0] : undefined;
    if (sub && table[sub]) process.stdout.write(`${commandUsage(PROG, sub, table[sub])}\n`);
    else process.stdout.write(`${programUsage(PROG, INTRO, table)}\n`);
    if (name === undefined) process.exitCode = 2;
    return;
  }
  const cmd: Command | undefined = table[name];
  if (!cmd) throw new UsageError(`unknown command '${name}'; commands: ${Object.keys(table).join(', ')} (see '${PROG} --help')`);
  const parsed = parseCommand(PROG, name, cmd, rest);
  if (parsed === 'help') {
    process.stdout.write(`${commandUsage(PROG, name, cmd)}\n`);
    return;
  }
  await cmd.run(parsed);
}

/** Runs the command line and exits with its code: 2 for an operator mistake, 1 for a failure. */
export function cli(argv: string[]): void {
  // The reader went away (`tinker-broker futures ID | head -3`): stop quietly, as Unix tools do.
  process.stdout.on('error', (e: NodeJS.ErrnoException) => {
    if (e.code === 'EPIPE') process.exit(0);
    throw e;
  });
  main(argv).catch((err) => {
    if (err instanceof UsageError || err instanceof PresetError || err instanceof StartRefused) {
      process.stderr.write(`${err.message}\n`);
      process.exit(2);
    }
    logger.error('tinker-broker failed', { error: String(err?.stack ?? err) });
    process.exit(1);
  });
}

if (process.argv[1] && import.meta.url === pathToFileURL(process.argv[1]).href) cli(process.argv.slice(2));
