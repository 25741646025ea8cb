import { spawn } from 'node:child_process';
import path from 'node:path';
import { fileURLToPath } from 'node:url';
import http from 'node:http';
import type { AddressInfo } from 'node:net';
import { performance } from 'node:perf_hooks';
import { createInterface } from 'node:readline';
import { Redis } from 'ioredis';
import { PYTHON } from '../test/e2e/server.js';
import { REDIS_URL } from '../test/helpers/stack.js';
import { post, runBench } from './client.js';

/**
 * The floor under bench/overhead.ts's 1-client figure on this machine: the same hops with nothing
 * of the broker in them. A client submits an op over HTTP (node:http, kept alive); the server makes
 * one Redis round trip (a script that stores the op), hands the op to an engine process over a pipe,
 * and answers the submit; the client then asks for the result, which the server answers as soon as
 * the engine replies. The engine's time is stamped as the broker's agent stamps it: from the call
 * going out on the pipe to its answer read back. The engine (bench/floor_engine.py) keeps the CPU
 * busy with torch for as long as the tiny model's ops take (alternately `fbMs` and `osMs`), so the
 * machine is as idle or as busy between hops as under the real bench.
 *
 *   overhead = client-observed time − the engine's own interval (as in bench/overhead.ts)
 *
 * bench/overhead.ts runs it after its 1-client run, with that run's engine times, and prints both.
 *
 *   node --import tsx bench/floor.ts [ops=300] [fbMs=11] [osMs=3]
 */
const now = () => performance.timeOrigin + performance.now();

/** The floor's overhead per op (ms, sorted), over `ops` ops after 10 of warm-up. */
export async function floorOverheads(ops: number, fbMs: number, osMs: number): Promise<number[]> {
  const redis = new Redis(REDIS_URL);
  const prefix = `floor-${process.pid}`;
  const engine = spawn(PYTHON, [new URL('./floor_engine.py', import.meta.url).pathname], { stdio: ['pipe', 'pipe', 'inherit'] });
  const done = new Map<number, { engine: [number, number] }>();
  const waiting = new Map<number, (r: { engine: [number, number] }) => void>();
  const sent = new Map<number, number>();
  createInterface({ input: engine.stdout! }).on('line', (line) => {
    const { id } = JSON.parse(line) as { id: number };
    // The engine's interval as the broker's agent stamps it: from the call to its answer, in this process.
    const r = { id, engine: [sent.get(id)!, now()] as [number, number] };
    const w = waiting.get(r.id);
    if (w) w(r);
    else done.set(r.id, r);
  });
  const lua = "redis.call('SET', KEYS[1], ARGV[1], 'EX', 60) return 1";
  const server = http.createServer((req, res) => {
    const chunks: Buffer[] = [];
    req.on('data', (c: Buffer) => chunks.push(c));
    req.on('end', () => {
      const body = JSON.parse(Buffer.concat(chunks).toString('utf8')) as { id: number; ms?: number };
      const answer = (o: unknown) => res.setHeader('content-type', 'application/json').end(JSON.stringify(o));
      if (req.url === '/api/v1/submit') {
        void redis.eval(lua, 1, `${prefix}:${body.id}`, JSON.stringify(body)).then(() => {
          sent.set(body.id, now());
          engine.stdin!.write(JSON.stringify(body) + '\n');
          answer({ id: body.id });
        });
        return;
      }
      const r = done.get(body.id);
      if (r) return answer(r);
      waiting.set(body.id, answer);
    });
  });
  await new Promise<void>((r) => server.listen(0, '127.0.0.1', r));
  // The benchmarks' own client (kept-alive node:http), as bench/overhead.ts's clients use it.
  const base = `http://127.0.0.1:${(server.address() as AddressInfo).port}`;
  const overheads: number[] = [];
  for (let i = 0; i < ops + 10; i++) {
    const start = now();
    await post(base, '/submit', { id: i, ms: i % 2 ? fbMs : osMs });
    const r = (await post(base, '/result', { id: i })) as { engine: [number, number] };
    const end = now();
    if (i >= 10) overheads.push(end - start - (r.engine[1] - r.engine[0]));
  }
  engine.stdin!.end();
  server.closeAllConnections();
  server.close();
  const keys = await redis.keys(`${prefix}:*`);
  if (keys.length) await redis.del(...keys);
  redis.disconnect();
  return overheads.sort((a, b) => a - b);
}

if (process.argv[1] && fileURLToPath(import.meta.url) === path.resolve(process.argv[1]))
  runBench(async () => {
    const [ops, fbMs, osMs] = [Number(process.argv[2] ?? 300), Number(process.argv[3] ?? 11), Number(process.argv[4] ?? 3)];
    const o = await floorOverheads(ops, fbMs, osMs);
    const pct = (p: number) => o[Math.min(o.length - 1, Math.floor(p * o.length))]!.toFixed(2);
    console.log(`floor, 1 client, ${ops} ops (engine ${fbMs} / ${osMs} ms): overhead p50 ${pct(0.5)} ms, p99 ${pct(0.99)} ms`);
  });
