import { Redis } from 'ioredis';
import { TINY_MODEL_ALIAS } from '../scripts/stack.js';
import { E2EServer } from '../test/e2e/server.js';
import { REDIS_URL } from '../test/helpers/stack.js';
import { encodeForwardBackward } from '../test/helpers/wire.js';
import { BENCH_ADAM, benchBatch, post, result, runBench } from './client.js';
import { children, cpuMs } from './proc.js';

/**
 * What one training op costs the machine, in figures that its load hardly moves (bench/overhead.ts
 * times the same ops, which a busy machine stretches): against the server as a user starts it
 * (`tinker-broker start`), one client alternating forward_backward (2 × 32 tokens) and optim_step,
 * each awaited before the next, it prints per op
 * - the CPU time of the start command's process (the API and the agent) and of the engine process
 *   (Linux /proc: user + system),
 * - the Redis round trips under the deployment's prefix, from MONITOR: one per command a client
 *   sends, a MULTI … EXEC counted once, commands run inside scripts not counted,
 * - the client-observed p50 (for orientation only).
 *
 *   node --import tsx bench/op-cost.ts [ops=200] [--json]
 *   node --import tsx bench/op-cost.ts sample [n=32] [rounds=5] [--json]
 *     the same figures per sample request (POST /asample, then POST /retrieve_future) while n
 *     one-sample requests (16-token prompt, 16 new tokens) run concurrently, `rounds` times; also
 *     every MONITOR line under the prefix (a MULTI's commands each, script-internal ones not).
 */
const positional = process.argv.slice(2).filter((a) => !a.startsWith('--'));
const sampleMode = positional[0] === 'sample';
const ops = Number((sampleMode ? positional[1] : positional[0]) ?? (sampleMode ? 32 : 200));
const rounds = Number((sampleMode ? positional[2] : undefined) ?? 5);
const json = process.argv.includes('--json');

/** Counts the round trips of the clients whose commands name `prefix`, until `stop()`. */
async function countRoundTrips(prefix: string): Promise<{ count: () => number; lines: () => number; stop: () => void }> {
  // No ready check (its INFO, echoed by MONITOR, confused the client's reply queue now and then).
  const conn = new Redis(REDIS_URL, { enableReadyCheck: false });
  const monitor = await conn.monitor();
  let n = 0;
  let lines = 0;
  const inMulti = new Set<string>();
  monitor.on('monitor', (_time: string, args: unknown[], source: string) => {
    if (source === 'lua') return;
    const cmd = String(args[0]).toLowerCase();
    const named = args.some((a) => String(a).includes(prefix));
    if (named) lines++;
    if (cmd === 'multi') inMulti.add(source);
    else if (cmd === 'exec') n += inMulti.delete(source) ? 1 : 0;
    else if (!inMulti.has(source) && named) n++;
  });
  return {
    count: () => n,
    lines: () => lines,
    stop: () => {
      monitor.disconnect();
      conn.disconnect();
    },
  };
}

/** What one sample request costs while `n` run concurrently (see the header). */
async function sampleCost(): Promise<void> {
  const n = ops;
  const server = new E2EServer({ TB_LONG_POLL_MS: '25000' });
  try {
    await server.start();
    const base = server.baseUrl;
    const session = (await post(base, '/create_session', { tags: [], user_metadata: {}, sdk_version: '0.38.0', type: 'create_session' })).session_id;
    const sc = await post(base, '/create_sampling_session', { session_id: session, sampling_session_seq_id: 0, base_model: TINY_MODEL_ALIAS });
    let seq = 0;
    const one = async () => {
      const i = seq++;
      const prompt = Array.from({ length: 16 }, (_, j) => 5 + ((i * 31 + j * 7) % 1000));
      const sub = await post(base, '/asample', {
        prompt: { chunks: [{ type: 'encoded_text', tokens: prompt }] },
        num_samples: 1,
        sampling_params: { max_tokens: 16, temperature: 1, seed: i, stop: [] },
        sampling_session_id: sc.sampling_session_id,
        seq_id: i,
      });
      await result(base, sub.request_id);
    };
    const round = () => Promise.all(Array.from({ length: n }, one));
    await round(); // warm-up
    const broker = server.pid!;
    const engine = children(broker)[0]!;
    const trips = await countRoundTrips(server.prefix);
    const [b0, e0] = [cpuMs(broker)!, cpuMs(engine)!];
    const times: number[] = [];
    for (let r = 0; r < rounds; r++) {
      const t = performance.now();
      await round();
      times.push(performance.now() - t);
    }
    const [b1, e1] = [cpuMs(broker)!, cpuMs(engine)!];
    await new Promise((r) => setTimeout(r, 300));
    trips.stop();
    const reqs = n * rounds;
    const load = (await import('node:os')).loadavg()[0]!;
    const out = {
      requests: reqs,
      concurrent: n,
      brokerCpuMsPerRequest: (b1 - b0) / reqs,
      engineCpuMsPerRequest: (e1 - e0) / reqs,
      redisRoundTripsPerRequest: trips.count() / reqs,
      monitorLinesPerRequest: trips.lines() / reqs,
      roundMsMedian: times.sort((a, b) => a - b)[Math.floor(rounds / 2)]!,
      load,
    };
    if (json) console.log(JSON.stringify(out));
    else
      console.log(
        `${reqs} sample requests, ${n} at a time: per request, CPU ${out.brokerCpuMsPerRequest.toFixed(2)} ms in the API+agent process, ${out.engineCpuMsPerRequest.toFixed(2)} ms in the engine; ` +
          `${out.redisRoundTripsPerRequest.toFixed(2)} Redis round trips (${out.monitorLinesPerRequest.toFixed(2)} MONITOR lines under the prefix); median round ${out.roundMsMedian.toFixed(0)} ms; load average ${load.toFixed(1)}`,
      );
  } finally {
    await server.destroy();
  }
}

async function main(): Promise<void> {
  if (sampleMode) return sampleCost();
  const server = new E2EServer({ TB_LONG_POLL_MS: '25000' });
  try {
    await server.start();
    const base = server.baseUrl;
    const session = (await post(base, '/create_session', { tags: [], user_metadata: {}, sdk_version: '0.38.0', type: 'create_session' })).session_id;
    const cm = await post(base, '/create_model', { session_id: session, model_seq_id: 0, base_model: TINY_MODEL_ALIAS, lora_config: { rank: 8, seed: 0 } });
    const modelId = (await result(base, cm.request_id)).model_id;
    const batch = benchBatch(32);
    const op = async (seq: number) => {
      const sub =
        seq % 2 === 1
          ? await post(base, '/forward_backward', undefined, encodeForwardBackward({ modelId, seqId: seq, data: batch }))
          : await post(base, '/optim_step', { model_id: modelId, seq_id: seq, adam_params: BENCH_ADAM });
      await result(base, sub.request_id);
    };
    // Warm-up: the first ops compile paths in the engine and the API.
    for (let seq = 1; seq <= 10; seq++) await op(seq);
    const broker = server.pid!;
    const engine = children(broker)[0]!;
    const trips = await countRoundTrips(server.prefix);
    const [b0, e0] = [cpuMs(broker)!, cpuMs(engine)!];
    const times: number[] = [];
    for (let seq = 11; seq < 11 + ops; seq++) {
      const t = performance.now();
      await op(seq);
      times.push(performance.now() - t);
    }
    const [b1, e1] = [cpuMs(broker)!, cpuMs(engine)!];
    // The last op's trailing commands (metrics, the read-once expiry) land after its answer.
    await new Promise((r) => setTimeout(r, 300));
    trips.stop();
    times.sort((a, b) => a - b);
    const load = (await import('node:os')).loadavg()[0]!;
    const out = {
      ops,
      brokerCpuMsPerOp: (b1 - b0) / ops,
      engineCpuMsPerOp: (e1 - e0) / ops,
      redisRoundTripsPerOp: trips.count() / ops,
      clientP50Ms: times[Math.floor(ops / 2)]!,
      load,
    };
    if (json) console.log(JSON.stringify(out));
    else
      console.log(
        `${ops} ops: per op, CPU ${out.brokerCpuMsPerOp.toFixed(2)} ms in the API+agent process, ${out.engineCpuMsPerOp.toFixed(2)} ms in the engine; ` +
          `${out.redisRoundTripsPerOp.toFixed(2)} Redis round trips; client-observed p50 ${out.clientP50Ms.toFixed(2)} ms; load average ${load.toFixed(1)}`,
      );
  } finally {
    await server.destroy();
  }
}

runBench(main);
