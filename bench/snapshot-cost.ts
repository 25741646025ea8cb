import { TINY_MODEL_ALIAS } from '../scripts/stack.js';
import { E2EServer } from '../test/e2e/server.js';
import { encodeForwardBackward } from '../test/helpers/wire.js';
import { BENCH_ADAM, benchBatch, post, result, runBench } from './client.js';

/**
 * What continuous snapshots cost a training loop (workers/snapshots.ts): the start command as a
 * user starts it, one client running forward_backward + optim_step steps (each op awaited), with a
 * snapshot after every optim_step (TB_SNAPSHOT_EVERY_STEPS=1, the default) against none
 * (TB_SNAPSHOT_EVERY_STEPS=0). The two run alternately, `rounds` times each, on fresh servers;
 * it prints each round's median step time and the ratio of the medians over all rounds.
 *
 *   node --import tsx bench/snapshot-cost.ts [steps=100] [rounds=3] [rank=8] [seqLen=32]
 */
const [steps, rounds, rank, seqLen] = [100, 3, 8, 32].map((d, i) => Number(process.argv[2 + i] ?? d)) as [number, number, number, number];

async function medianStepMs(everySteps: number): Promise<number> {
  const server = new E2EServer({ TB_SNAPSHOT_EVERY_STEPS: String(everySteps), TB_LONG_POLL_MS: '25000' });
  try {
    await server.start();
    const base = server.baseUrl;
    const session = (await post(base, '/create_session', { tags: [], user_metadata: {}, sdk_version: '0.38.0', type: 'create_session' })).session_id;
    const cm = await post(base, '/create_model', { session_id: session, model_seq_id: 0, base_model: TINY_MODEL_ALIAS, lora_config: { rank, seed: 0 } });
    const modelId = (await result(base, cm.request_id)).model_id;
    const batch = benchBatch(seqLen);
    let seq = 1;
    const step = async () => {
      const fb = await post(base, '/forward_backward', undefined, encodeForwardBackward({ modelId, seqId: seq++, data: batch }));
      await result(base, fb.request_id);
      const opt = await post(base, '/optim_step', { model_id: modelId, seq_id: seq++, adam_params: BENCH_ADAM });
      await result(base, opt.request_id);
    };
    for (let i = 0; i < 5; i++) await step(); // warm-up
    const times: number[] = [];
    for (let i = 0; i < steps; i++) {
      const t = performance.now();
      await step();
      times.push(performance.now() - t);
    }
    return median(times);
  } finally {
    await server.stop();
  }
}

function median(xs: number[]): number {
  const s = [...xs].sort((a, b) => a - b);
  return s[Math.floor(s.length / 2)]!;
}

runBench(async () => {
  const on: number[] = [];
  const off: number[] = [];
  for (let r = 0; r < rounds; r++) {
    off.push(await medianStepMs(0));
    on.push(await medianStepMs(1));
    console.log(`round ${r + 1}: step p50 without snapshots ${off.at(-1)!.toFixed(2)} ms, with a snapshot every step ${on.at(-1)!.toFixed(2)} ms`);
  }
  console.log(`steps=${steps} rounds=${rounds} rank=${rank} seqLen=${seqLen}: with/without = ${(median(on) / median(off)).toFixed(3)} (medians ${median(on).toFixed(2)} / ${median(off).toFixed(2)} ms)`);
});
