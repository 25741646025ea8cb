import { readFileSync } from 'node:fs';
import { Redis } from 'ioredis';
import { TINY_MODEL_ALIAS } from '../scripts/stack.js';
import { E2EServer } from '../test/e2e/server.js';
import { REDIS_URL } from '../test/helpers/stack.js';
import { encodeForwardBackward } from '../test/helpers/wire.js';
import { BENCH_ADAM, benchBatch, post, result, runBench } from './client.js';

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
 */
const ops = Number(process.argv.slice(2).find((a) => !a.startsWith('--')) ?? 200);
const json = process.argv.includes('--json');

/** CPU ms a process has used (utime + stime; clock ticks of 10 ms). */
function cpuMs(pid: number): number {
  const f = readFileSync(`/proc/${pid}/stat`, 'utf8').split(') ')[1]!.split(' ');
  return (Number(f[11]) + Number(f[12])) * 10;
}

function children(pid: number): number[] {
  return readFileSync(`/proc/${pid}/task/${pid}/children`, 'utf8').trim().split(/\s+/).filter(Boolean).map(Number);
}

/** Counts the round trips of the clients whose commands name `prefix`, until `stop()`. */
async function countRoundTrips(prefix: string): Promise<{ count: () => number; stop: () => void }> {
  const conn = new Redis(REDIS_URL);
  const monitor = await conn.monitor();
  let n = 0;
  const inMulti = new Set<string>();
  monitor.on('monitor', (_time: string, args: unknown[], source: string) => {
    if (source === 'lua') return;
    const cmd = String(args[0]).toLowerCase();
    if (cmd === 'multi') inMulti.add(source);
    else if (cmd === 'exec') n += inMulti.delete(source) ? 1 : 0;
    else if (!inMulti.has(source) && args.some((a) => String(a).includes(prefix))) n++;
  });
  return {
    count: () => n,
    stop: () => {
      monitor.disconnect();
      conn.disconnect();
    },
  };
}

async function main(): Promise<void> {
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
    const [b0, e0] = [cpuMs(broker), cpuMs(engine)];
    const times: number[] = [];
    for (let seq = 11; seq < 11 + ops; seq++) {
      const t = performance.now();
      await op(seq);
      times.push(performance.now() - t);
    }
    const [b1, e1] = [cpuMs(broker), cpuMs(engine)];
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
