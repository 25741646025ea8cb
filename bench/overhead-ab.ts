import { spawnSync } from 'node:child_process';
import os from 'node:os';
import path from 'node:path';

/**
 * A/B of bench/overhead.ts: two checkouts (e.g. the commit before a change and after it) measured in
 * one run, rounds alternating A, B, B, A, ... so the load of a shared machine weighs on both alike.
 * Each round runs this checkout's bench/overhead.ts with the other checkout as its working directory
 * (so it starts that checkout's server); prints each round and the ratios B/A of the medians.
 *
 *   node --import tsx bench/overhead-ab.ts <dirA> <dirB> [rounds=3] [opsPerClient1] [opsPerClient64] [sdkSteps]
 */
const [dirA, dirB, roundsArg, ...rest] = process.argv.slice(2);
if (!dirA || !dirB) throw new Error('usage: overhead-ab.ts <dirA> <dirB> [rounds] [ops1] [ops64] [sdkSteps]');
const rounds = Number(roundsArg ?? 3);
const bench = path.resolve('bench/overhead.ts');

type Out = {
  one: { p50: number; p99: number; cpuPerOp: { server: number; engine: number | null; redis: number | null } | null };
  /** The same hops without the broker (bench/floor.ts): the same code in A and B, so B/A shows the run's noise. */
  floor: { p50: number };
  many: { p50: number; p99: number; gapP50: number };
  sdk: { sdk_p50_ms: number; plain_healthz_p50_ms: number; plain_404_p50_ms: number; ratio_healthz: number; ratio_404: number };
  load: number;
};
const runs: Record<'A' | 'B', Out[]> = { A: [], B: [] };
for (let r = 0; r < rounds; r++) {
  for (const which of (r % 2 === 0 ? ['A', 'B'] : ['B', 'A']) as ('A' | 'B')[]) {
    const dir = path.resolve(which === 'A' ? dirA : dirB);
    const p = spawnSync(process.execPath, ['--import', 'tsx', bench, ...rest, '--json'], { cwd: dir, encoding: 'utf8', timeout: 900_000 });
    if (p.status !== 0) throw new Error(`${which} round ${r + 1} failed:\n${p.stderr.slice(-3000)}`);
    const out = JSON.parse(p.stdout.trim().split('\n').pop()!) as Out;
    runs[which].push(out);
    const f = (x: number) => x.toFixed(2);
    console.log(
      `round ${r + 1} ${which}: 1 client p50 ${f(out.one.p50)} p99 ${f(out.one.p99)} ms | 64 clients p50 ${f(out.many.p50)} p99 ${f(out.many.p99)} ms | ` +
        `SDK optim_step ${f(out.sdk.sdk_p50_ms)} ms = ${f(out.sdk.ratio_healthz)}x two healthz, ${f(out.sdk.ratio_404)}x two 404s | load ${out.load.toFixed(1)}`,
    );
  }
}
const med = (xs: number[]) => [...xs].sort((a, b) => a - b)[Math.floor(xs.length / 2)]!;
const rows: [string, (o: Out) => number][] = [
  ['1 client overhead p50 (ms)', (o) => o.one.p50],
  ['1 client overhead p99 (ms)', (o) => o.one.p99],
  ['1 client floor p50 (ms, control)', (o) => o.floor.p50],
  ['1 client CPU per op, API+agent (ms)', (o) => o.one.cpuPerOp?.server ?? NaN],
  ['1 client CPU per op, Redis (ms)', (o) => o.one.cpuPerOp?.redis ?? NaN],
  ['1 client CPU per op, engine (ms)', (o) => o.one.cpuPerOp?.engine ?? NaN],
  ['64 clients overhead p50 (ms)', (o) => o.many.p50],
  ['64 clients overhead p99 (ms)', (o) => o.many.p99],
  ['64 clients engine idle gap p50 (ms)', (o) => o.many.gapP50],
  ['SDK optim_step p50 (ms)', (o) => o.sdk.sdk_p50_ms],
  ['SDK optim_step / two healthz', (o) => o.sdk.ratio_healthz],
  ['SDK optim_step / two 404s', (o) => o.sdk.ratio_404],
];
console.log(`\nmedians of ${rounds} rounds (A = ${dirA}, B = ${dirB}); load average now ${os.loadavg()[0]!.toFixed(1)}`);
for (const [name, get] of rows) {
  const a = med(runs.A.map(get));
  const b = med(runs.B.map(get));
  console.log(`${name.padEnd(36)} A ${a.toFixed(2).padStart(8)}  B ${b.toFixed(2).padStart(8)}  B/A ${(b / a).toFixed(2)}`);
}
