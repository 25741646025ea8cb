import { expect } from 'chai';
import { rmSync } from 'node:fs';
import { decodeRequestId } from '../queues/contract/futures.js';
import { Outcomes } from '../queues/runtime/outcomes.js';
import { Client } from './helpers/client.js';
import { spawnAgent, stackEnv, startApi, stopAgent, waitFor, type AgentProc, type Api } from './helpers/procs.js';
import { REDIS_URL } from './helpers/stack.js';
import type { TestDatum } from './helpers/wire.js';

/**
 * Co-batching through the product (issue 34; workers/agent/training.ts, tinker_engine/cobatch.py):
 * four training loops of different LoRA ranks and losses run at once against one agent with
 * TB_COBATCH_MAX=4 and a gather window, so their forward_backward ops meet in the agent's queue and
 * run in shared engine passes; then a twin of each loop runs alone. Every loop's losses equal its twin's up to float32
 * summation order, and some ops did run co-batched (their outcome records say so). Real processes:
 * the API here, the agent spawned, its engine its child.
 */
const STEPS = 4;
const LOOPS = [
  { seed: 1, rank: 2, loss: 'cross_entropy' },
  { seed: 2, rank: 4, loss: 'cross_entropy' },
  { seed: 3, rank: 8, loss: 'importance_sampling' },
  { seed: 4, rank: 4, loss: 'importance_sampling' },
];

/** Step i's datums of loop k: mixed lengths, the same for a loop and its twin. */
function batch(k: number, i: number, loss: string): TestDatum[] {
  const t = (j: number) => ((k * 53 + i * 31 + j * 7) % 250) + 1;
  const lengths = [3 + k, 6 + ((i + k) % 4)];
  return lengths.map((n, d) => {
    const tokens = Array.from({ length: n }, (_, j) => t(j + d * 11));
    const targets = Array.from({ length: n }, (_, j) => t(j + 1 + d * 11));
    if (loss === 'cross_entropy') return { tokens, targets, weights: tokens.map(() => 1) };
    return { tokens, targets, logprobs: tokens.map((_, j) => -1 - ((j + k) % 3) * 0.5), advantages: tokens.map((_, j) => ((j + i) % 2 ? 1 : -0.5)) };
  });
}

describe('co-batching: concurrent loops share engine passes and keep their solo losses', function () {
  this.timeout(600_000);
  let st: ReturnType<typeof stackEnv>;
  let api: Api;
  let agent: AgentProc;

  before(async () => {
    st = stackEnv(REDIS_URL);
    api = await startApi(st.env);
    // With a gather window (TB_COBATCH_WAIT_MS): a pass waits, bounded, for the loops a round trip late.
    agent = spawnAgent({ ...st.env, TB_AGENT_ID: `cb-${st.prefix}`, TB_COBATCH_MAX: '4', TB_COBATCH_WAIT_MS: '200' });
    await waitFor('agent registered', async () => {
      if (agent.child.exitCode !== null) throw new Error(`agent exited: ${agent.log()}`);
      return (await api.built.ctx.registry.agents.live()).some((r) => r.agent_id === agent.id && r.models.length > 0);
    }, 120_000);
  });
  after(async function () {
    if (this.currentTest?.state === 'failed') console.log(agent.log().split('\n').slice(-40).join('\n'));
    await stopAgent(agent);
    await api.stop();
    rmSync(st.storage, { recursive: true, force: true });
  });

  async function loop(client: Client, k: number, jobs?: string[]): Promise<number[]> {
    const { seed, rank, loss } = LOOPS[k]!;
    const model = await client.createModel(seed, rank);
    const losses: number[] = [];
    for (let i = 0; i < STEPS; i++) {
      const fb = await client.submitFb(model, batch(k, i, loss), loss);
      jobs?.push(fb);
      losses.push(await client.loss(fb));
      await client.optim(model);
    }
    return losses;
  }

  it('every loop equals its twin run alone; some forward_backward ops ran co-batched', async () => {
    const clients = await Promise.all(LOOPS.map(async () => {
      const c = new Client(api);
      await c.init();
      return c;
    }));
    const jobs: string[] = [];
    const together = await Promise.all(LOOPS.map((_, k) => loop(clients[k]!, k, jobs)));
    const outcomes = new Outcomes(api.built.ctx.redis, api.built.ctx.names, 60);
    const sizes = await Promise.all(jobs.map(async (id) => (await outcomes.get(decodeRequestId(id)!.jobId))?.cobatch ?? 1));
    console.log(`      [cobatch] forward_backward ops by engine pass size: ${JSON.stringify(sizes.reduce<Record<number, number>>((a, n) => ({ ...a, [n]: (a[n] ?? 0) + 1 }), {}))}`);
    expect(Math.max(...sizes), 'some ops shared an engine pass').to.be.above(1);
    for (const [k] of LOOPS.entries()) {
      const alone = await loop(clients[k]!, k);
      // Float32 summation order only (a pass over more rows, an adapter over gathered rows), through
      // STEPS AdamW steps: far below what a dropped, doubled or mixed-up datum changes (O(1)).
      for (let i = 0; i < STEPS; i++) expect(Math.abs(together[k]![i]! - alone[i]!), `loop ${k} step ${i}: ${together[k]} vs ${alone}`).to.be.at.most(1e-4 * Math.abs(alone[i]!) + 1e-5);
    }
  });
});
