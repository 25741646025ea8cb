import { readdirSync, readFileSync } from 'node:fs';
import path from 'node:path';
import { expect } from 'chai';
import { loadAgentConfig, type AgentConfig } from '../queues/infra/config.js';
import { logger } from '../queues/infra/logger.js';
import { EngineCapabilities as RecordedCapabilities } from '../queues/registry/agents.js';
import { Engine, ModelSpec } from '../presets/schema.js';
import { defaultEngine, engineCatalogue, engineKinds, engineOf, recordCapabilities } from '../workers/adapters/index.js';

/**
 * Engine capabilities are declared once, in each adapter's registration (workers/adapters/registry.ts).
 * This fails when one is stated a second place: an old table or list of engines, an engine name
 * compared outside the adapters, an adapter restating what its registration says, or a consumer
 * (presets, config, the agents' records) whose view differs from the registry's.
 */
const ROOT = path.resolve(import.meta.dirname, '..');
const PRODUCTION = ['api', 'queues', 'workers', 'presets', 'scripts'];

function sources(): { file: string; code: string }[] {
  return PRODUCTION.flatMap((dir) =>
    readdirSync(path.join(ROOT, dir), { recursive: true, withFileTypes: true })
      .filter((f) => f.isFile() && f.name.endsWith('.ts') && !f.parentPath.includes('node_modules'))
      .map((f) => path.relative(ROOT, path.join(f.parentPath, f.name))),
  ).map((file) => ({ file, code: withoutComments(readFileSync(path.join(ROOT, file), 'utf8')) }));
}

/** The code of a TypeScript file without its comments (a `//` inside a string ends its line early: that only hides text). */
function withoutComments(text: string): string {
  return text.replace(/\/\*[\s\S]*?\*\//g, '').replace(/(^|[^:'"`])\/\/.*$/gm, '$1');
}

const log = logger.child({ test: 'engine-capabilities' });
const config = (over: Partial<AgentConfig>): AgentConfig => ({
  redisUrl: 'redis://x', prefix: 'p', storageDir: '/tmp', retentionS: 1, agentId: 'a', python: 'python3', engineDevice: 'cpu', sampleConcurrency: 1, engineRestart: false,
  models: [{ name: '/m/a', path: '/m/a', aliases: [], trainable: true, loraMaxRank: 8, topkMax: 5 }],
  ...over,
});

describe('engine capabilities, declared once', () => {
  it('has no table or list of engines besides the registry', () => {
    const old = /\b(ENGINES|ENGINE_KINDS|SAMPLE_ENGINE_ORDER|TRAIN_ONLY_ENGINES|EngineKind)\b/;
    const found = sources().filter((s) => old.test(s.code)).map((s) => s.file);
    expect(found).to.deep.equal([]);
  });

  it('names no engine in code outside the adapters (what an engine does is read from its registration)', () => {
    const kinds = engineKinds();
    expect(kinds).to.include.members(['torch', 'vllm', 'verl']);
    const literal = new RegExp(`['"\`](${kinds.join('|')})['"\`]`);
    const all = sources();
    // The scanner works: the adapters' registrations name their kinds.
    expect(all.filter((s) => s.file.startsWith(`workers${path.sep}adapters${path.sep}`) && literal.test(s.code))).to.have.length.of.at.least(kinds.length);
    const found = all
      .filter((s) => !s.file.startsWith(`workers${path.sep}adapters${path.sep}`))
      .flatMap((s) => s.code.split('\n').filter((l) => literal.test(l)).map((l) => `${s.file}: ${l.trim()}`));
    expect(found).to.deep.equal([]);
  });

  it("builds each engine's adapter from its registration, and no adapter restates a capability", () => {
    const devices: Record<string, string> = { verl: 'cuda:0,1' };
    for (const kind of engineKinds()) {
      const def = engineOf(kind);
      const adapter = def.create(config({ engine: kind, engineDevice: devices[kind] ?? 'cpu' }), log);
      expect(adapter.kind, kind).to.equal(kind);
      for (const key of ['trains', 'samples', 'samplePriority', 'drains', 'gpuOnly', 'capabilities']) expect(adapter, `${kind} adapter's ${key}`).to.not.have.property(key);
      // An adapter's own sampleLacks are what it lacks on its device beyond its engine's.
      expect((adapter.sampleLacks ?? []).filter((f) => def.capabilities.sampleLacks.includes(f)), kind).to.deep.equal([]);
      if (def.capabilities.sampleBatch) expect(adapter.sampleBatch, `${kind} declares sampleBatch`).to.be.a('function');
    }
  });

  it('gives presets and config parsing the registered kinds, the default and which train', () => {
    for (const kind of engineKinds()) expect(Engine.safeParse(kind).success, kind).to.equal(true);
    expect(Engine.safeParse('tensorflow').success).to.equal(false);
    expect(ModelSpec.parse({ name: 'a', path: '/m/a', role: 'actor' }).engine).to.equal(defaultEngine());
    const env = { TB_AGENT_MODELS: '/m/a', TB_AGENT_ID: 'a' };
    expect(loadAgentConfig(env, undefined, engineCatalogue()).engine).to.equal(defaultEngine());
    for (const kind of engineKinds()) {
      const c = loadAgentConfig({ ...env, TB_ENGINE: kind }, undefined, engineCatalogue());
      expect(c.models[0]!.trainable, kind).to.equal(engineOf(kind).capabilities.trains);
    }
    expect(() => loadAgentConfig({ ...env, TB_ENGINE: 'tensorflow' }, undefined, engineCatalogue())).to.throw(/TB_ENGINE: Invalid option/);
  });

  it("publishes in the agents' records exactly the capabilities their schema reads", () => {
    for (const kind of engineKinds()) {
      const published = recordCapabilities(engineOf(kind).capabilities);
      expect(Object.keys(published.capabilities).sort(), kind).to.deep.equal(Object.keys(RecordedCapabilities.shape).sort());
      expect(RecordedCapabilities.parse(published.capabilities)).to.deep.equal(published.capabilities);
      expect(published.sample_lacks).to.deep.equal([...engineOf(kind).capabilities.sampleLacks]);
    }
  });
});
