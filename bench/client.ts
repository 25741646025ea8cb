import { E2E_KEY } from '../test/e2e/server.js';
import type { TestDatum } from '../test/helpers/wire.js';

/**
 * The benchmarks' HTTP client: plain fetch with the e2e key, JSON or protobuf bodies, and a
 * future's answer waited for as the SDK waits (again at once on try_again).
 */

/** One POST to /api/v1<route>; its JSON answer, or an error naming the route and status. */
export async function post(base: string, route: string, body: unknown, raw?: Buffer): Promise<any> {
  const headers: Record<string, string> = { 'x-api-key': E2E_KEY, 'content-type': raw ? 'application/x-protobuf' : 'application/json' };
  const res = await fetch(`${base}/api/v1${route}`, { method: 'POST', headers, body: raw ? new Uint8Array(raw) : JSON.stringify(body) });
  const text = await res.text();
  if (res.status !== 200) throw new Error(`${route}: ${res.status} ${text}`);
  return JSON.parse(text);
}

/** A future's answer; throws when it failed. */
export async function result(base: string, requestId: string): Promise<any> {
  for (;;) {
    const r = await post(base, '/retrieve_future', { request_id: requestId, allow_metadata_only: false });
    if (r.type === 'try_again') continue;
    if (r.error) throw new Error(`${requestId}: ${r.error}`);
    return r;
  }
}

/** The benchmarks' training batch: two sequences of `seqLen` tokens, every target weighted. */
export function benchBatch(seqLen: number): TestDatum[] {
  return Array.from({ length: 2 }, (_, b) => {
    const toks = Array.from({ length: seqLen + 1 }, (_, i) => (b * 31 + i * 7) % 1000);
    return { tokens: toks.slice(0, -1), targets: toks.slice(1), weights: Array(seqLen).fill(1) };
  });
}

export const BENCH_ADAM = { learning_rate: 1e-4, beta1: 0.9, beta2: 0.95, eps: 1e-12, weight_decay: 0, grad_clip_norm: 0 };

/** A benchmark's entry: runs `main`, then exits 0, or prints the error and exits 1 (a server it started must not keep the process). */
export function runBench(main: () => Promise<void>): void {
  main().then(
    () => process.exit(0),
    (e) => {
      console.error(e);
      process.exit(1);
    },
  );
}
