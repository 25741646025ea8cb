import { spawnSync } from 'node:child_process';
import { readFileSync } from 'node:fs';
import path from 'node:path';
import { expect } from 'chai';
import {
  AGENT_ENV_NAMES,
  ENGINE_INTERNAL_ENV,
  ENGINE_LOG_LEVELS,
  ENGINE_SETTING_NAMES,
  engineSettingsEnv,
  loadAgentConfig,
  MODEL_DTYPES,
  VERL_ATTENTIONS,
  type BaseModelSpec,
} from '../queues/infra/config.js';
import { logger } from '../queues/infra/logger.js';
import { VERL_STRATEGIES, verlLaunch } from '../workers/adapters/verl.js';
import { engineProcessEnv } from '../workers/engine.js';

/**
 * The engines' settings have one definition each. A user's setting is a field of the agent's
 * configuration (queues/infra/config.ts, with its bound and default), which the agent passes to the
 * engine; the Python engines read their environment in one module per package
 * (workers/python/tinker_engine/settings.py, workers/python/tinker_engine_verl/settings.py). Here: no
 * other Python module reads a `TB_` variable; every variable the engines read is an agent setting, one
 * the agent sets from its models, or a listed internal knob; both sides accept the same values and the
 * engine takes the value the agent passes, defaults included; the engine process sees no setting the
 * configuration did not decide.
 */

const ROOT = path.resolve(import.meta.dirname, '..');
const PYTHON = path.join(ROOT, '.venv/bin/python');
const SETTINGS_MODULES = ['workers/python/tinker_engine/settings.py', 'workers/python/tinker_engine_verl/settings.py'];

/** The engines' Python sources, tests aside. */
function enginePythonFiles(): string[] {
  const listed = spawnSync('git', ['ls-files', '-co', '--exclude-standard', 'workers/python'], { cwd: ROOT, encoding: 'utf8' });
  expect(listed.status, listed.stderr).to.equal(0);
  return listed.stdout.split('\n').filter((f) => f.endsWith('.py') && !f.includes('/tests/'));
}

/** Values tried for every setting: numbers well and badly written, flags, names of each kind, in several cases. */
const PROBES = [
  '', '0', '1', '-1', '12', '007', '1.5', '1e3', ' 12', '+3', 'abc', 'true', 'false', 'TRUE', 'yes',
  'auto', 'AUTO', 'info', 'INFO', 'warning', 'Debug', 'CRITICAL', 'float32', 'bfloat16', 'fp8', 'sdpa', 'eager', 'flash_attention_2', 'SDPA',
];

type Described = Record<string, { default: unknown; choices: string[] | null }>;
type Loaded = { ok: true; values: Record<string, unknown> } | { ok: false; error: string };
type PythonView = { described: Described; loaded: Loaded[] };

/** What the Python settings modules say: each variable's default and choices; each environment given, parsed. */
const PROBE = `
import dataclasses, json, sys
from tinker_engine.settings import EngineSettings, SettingsError, describe, load
from tinker_engine_verl.settings import VerlSettings

CLASSES = (EngineSettings, VerlSettings)

def by_variable(cls, obj):
    return {f.metadata["variable"].name: getattr(obj, f.name) for f in dataclasses.fields(cls)}

def loaded(env):
    try:
        values = {}
        for cls in CLASSES:
            values.update(by_variable(cls, load(cls, env)))
        return {"ok": True, "values": values}
    except SettingsError as exc:
        return {"ok": False, "error": str(exc)}

described = {}
for cls in CLASSES:
    described.update(describe(cls))
print(json.dumps({"described": described, "loaded": [loaded(env) for env in json.load(sys.stdin)]}))
`;

function python(envs: Record<string, string>[]): PythonView {
  const run = spawnSync(PYTHON, ['-c', PROBE], { cwd: path.join(ROOT, 'workers/python'), input: JSON.stringify(envs), encoding: 'utf8', maxBuffer: 1 << 24 });
  expect(run.status, run.stderr).to.equal(0);
  return JSON.parse(run.stdout) as PythonView;
}

/** The engine's environment an agent configured with `env` passes (its settings), or the configuration's error. */
function agentPasses(env: Record<string, string>): Record<string, string> | Error {
  try {
    return engineSettingsEnv(loadAgentConfig({ TB_AGENT_MODELS: '/m/a', ...env }).engineSettings);
  } catch (e) {
    return e as Error;
  }
}

const spec = (over: Partial<BaseModelSpec> = {}): BaseModelSpec => ({ name: '/m/a', path: '/m/a', aliases: [], trainable: true, loraMaxRank: 8, topkMax: 5, ...over });

describe('one source for the engine settings (queues/infra/config.ts → the engines\' settings modules)', () => {
  let described: Described;

  before(function () {
    this.timeout(60_000);
    described = python([]).described;
  });

  it('no engine module but the settings modules reads a TB_ variable', () => {
    const files = enginePythonFiles();
    for (const m of SETTINGS_MODULES) expect(files, m).to.include(m);
    const found: string[] = [];
    for (const file of files.filter((f) => !SETTINGS_MODULES.includes(f))) {
      readFileSync(path.join(ROOT, file), 'utf8')
        .split('\n')
        .forEach((line, i) => {
          const code = line.replace(/#.*$/, '');
          // A TB_ variable's name as a string of its own: a key of the environment, however it is reached.
          const named = /(["'])TB_[A-Z0-9_]+\1/.test(code);
          // The environment itself: only an entry point's process setup (not our settings) touches it.
          const environ = /\b(environ|getenv|putenv)\b/.test(code) && !(path.basename(file) === '__main__.py' && !/TB_/.test(code));
          if (named || environ) found.push(`${file}:${i + 1}: ${line.trim()}`);
        });
    }
    expect(found).to.deep.equal([]);
  });

  it('every variable the engines read is an agent setting, set by the agent from its models, or internal', () => {
    const fromModels = Object.keys(verlLaunch('cuda', [spec({ offload: true, removePadding: true, gradientCheckpointing: true })]).env).filter((n) => n.startsWith('TB_'));
    expect(fromModels).to.have.members(['TB_VERL_STRATEGY', 'TB_VERL_OFFLOAD', 'TB_VERL_REMOVE_PADDING', 'TB_VERL_GRAD_CKPT']);
    const read = Object.keys(described);
    const known = new Set([...AGENT_ENV_NAMES, ...fromModels, ...ENGINE_INTERNAL_ENV]);
    expect(read.filter((n) => !known.has(n)), 'read by the engines, unknown to the agent').to.deep.equal([]);
    // And the other way: no agent setting for the engines, nor internal knob, that no engine reads.
    expect([...ENGINE_SETTING_NAMES, 'TB_ENGINE_DEVICE', ...fromModels, ...ENGINE_INTERNAL_ENV].filter((n) => !read.includes(n))).to.deep.equal([]);
    expect(ENGINE_INTERNAL_ENV.filter((n) => AGENT_ENV_NAMES.includes(n)), 'an internal knob is no agent setting').to.deep.equal([]);
  });

  it('the names each side accepts are the same lists', () => {
    expect(described.TB_ENGINE_DTYPE!.choices).to.deep.equal([...MODEL_DTYPES]);
    expect(described.TB_ENGINE_LOG_LEVEL!.choices).to.deep.equal([...ENGINE_LOG_LEVELS]);
    expect(described.TB_VERL_ATTN!.choices).to.deep.equal([...VERL_ATTENTIONS]);
    expect(described.TB_VERL_STRATEGY!.choices).to.deep.equal([...VERL_STRATEGIES]);
  });

  it('both sides accept the same values, and the engine takes the value the agent passes (defaults included)', function () {
    this.timeout(60_000);
    const cases = ENGINE_SETTING_NAMES.flatMap((name) => PROBES.map((value) => ({ name, value, passed: agentPasses({ [name]: value }) })));
    // Per case: the raw value as the engine would read it, then what the agent passes for it.
    const view = python(cases.flatMap((c) => [{ [c.name]: c.value }, c.passed instanceof Error ? {} : c.passed]));
    const mismatches: string[] = [];
    cases.forEach((c, i) => {
      const raw = view.loaded[2 * i]!;
      const agent = c.passed instanceof Error ? null : view.loaded[2 * i + 1]!;
      if (raw.ok !== !(c.passed instanceof Error)) mismatches.push(`${c.name}=${JSON.stringify(c.value)}: agent ${c.passed instanceof Error ? 'refuses' : 'accepts'}, engine ${raw.ok ? 'accepts' : `refuses (${raw.error})`}`);
      else if (agent && raw.ok) {
        if (!agent.ok) mismatches.push(`${c.name}=${JSON.stringify(c.value)}: the engine refuses what the agent passes (${agent.error})`);
        else if (JSON.stringify(agent.values[c.name]) !== JSON.stringify(raw.values[c.name]))
          mismatches.push(`${c.name}=${JSON.stringify(c.value)}: the agent's value gives ${JSON.stringify(agent.values[c.name])}, the engine's own ${JSON.stringify(raw.values[c.name])}`);
      }
    });
    expect(mismatches).to.deep.equal([]);
    // Every setting passes with a value unless the configuration leaves it to the engine (dtype: by device) or to the agent's log.
    expect(Object.keys(engineSettingsEnv())).to.have.members(ENGINE_SETTING_NAMES.filter((n) => n !== 'TB_ENGINE_DTYPE' && n !== 'TB_ENGINE_LOG_LEVEL'));
  });

  it('the engine reads what the verl adapter sets from the models', () => {
    const envs = VERL_STRATEGIES.flatMap((strategy) => [false, true].map((on) => verlLaunch('cuda:0,1', [spec({ strategy, offload: on, removePadding: on, gradientCheckpointing: !on })]).env as Record<string, string>));
    const view = python(envs);
    view.loaded.forEach((l, i) => {
      expect(l.ok, JSON.stringify(l)).to.equal(true);
      const e = envs[i]!;
      if (l.ok)
        expect([l.values.TB_VERL_STRATEGY, l.values.TB_VERL_OFFLOAD, l.values.TB_VERL_REMOVE_PADDING, l.values.TB_VERL_GRAD_CKPT]).to.deep.equal([
          e.TB_VERL_STRATEGY,
          e.TB_VERL_OFFLOAD === '1',
          e.TB_VERL_REMOVE_PADDING === '1',
          e.TB_VERL_GRAD_CKPT === '1',
        ]);
    });
  });

  it('hands the engine process only the settings the configuration decided, and the internal knobs', () => {
    const agentEnv = {
      PATH: '/usr/bin',
      TB_ENGINE_SAMPLE_TOKENS: 'not a number',
      TB_VERL_ATTN: 'bogus',
      TB_ENGINE_DTYPE: 'fp8',
      TB_ENGINE_CHECK_RESULTS: '1',
      TB_VERL_RECORD: '/tmp/fixtures',
      TB_LOSS_CATALOGUE: '/tmp/losses.json',
    };
    const log = logger.child({ test: 'one-source-engine-settings' });
    const settings = loadAgentConfig({ TB_AGENT_MODELS: '/m/a', TB_ENGINE_SAMPLE_TOKENS: '1000' }).engineSettings;
    const env = engineProcessEnv(agentEnv, { log, device: 'cpu', env: engineSettingsEnv(settings) });
    expect(env).to.include({ PATH: '/usr/bin', TB_ENGINE_SAMPLE_TOKENS: '1000', TB_VERL_ATTN: 'sdpa', TB_ENGINE_DEVICE: 'cpu' });
    expect(env).to.include({ TB_ENGINE_CHECK_RESULTS: '1', TB_VERL_RECORD: '/tmp/fixtures', TB_LOSS_CATALOGUE: '/tmp/losses.json' });
    expect(env).to.not.have.property('TB_ENGINE_DTYPE');
    // The log level: the agent's unless configured.
    const level = log.isLevelEnabled('debug') ? 'DEBUG' : log.isLevelEnabled('info') ? 'INFO' : log.isLevelEnabled('warn') ? 'WARNING' : 'ERROR';
    expect(env.TB_ENGINE_LOG_LEVEL).to.equal(level);
    const quiet = loadAgentConfig({ TB_AGENT_MODELS: '/m/a', TB_ENGINE_LOG_LEVEL: 'error' }).engineSettings;
    expect(engineProcessEnv(agentEnv, { log, env: engineSettingsEnv(quiet) }).TB_ENGINE_LOG_LEVEL).to.equal('ERROR');
    // Without settings (an engine started outside an agent), the engine gets every default.
    expect(engineProcessEnv(agentEnv, { log })).to.not.have.property('TB_ENGINE_SAMPLE_TOKENS');
  });
});
