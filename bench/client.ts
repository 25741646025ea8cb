import http from 'node:http';
import { E2E_KEY } from '../test/e2e/server.js';
import type { TestDatum } from '../test/helpers/wire.js';

/**
 * The benchmarks' HTTP client: node:http over kept-alive connections with the e2e key, JSON or
 * protobuf bodies, and a future's answer waited for as the SDK waits (again at once on try_again).
 * Not `fetch`: on the 2-core bench machine undici's fetch spends 0.4–0.7 ms more per request than
 * node:http against the same server (p50 0.88–1.15 ms against 0.47–0.49 ms for a bare POST), which
 * bench/overhead.ts would count as the broker's.
 */
const agent = new http.Agent({ keepAlive: true, maxSockets: 256 });

/** One POST to /api/v1<route>; its JSON answer, or an error naming the route and status. */
export function post(base: string, route: string, body: unknown, raw?: Buffer): Promise<any> {
  const payload = raw ?? Buffer.from(JSON.stringify(body));
  const headers = { 'x-api-key': E2E_KEY, 'content-type': raw ? 'application/x-protobuf' : 'application/json', 'content-length': payload.length };
  return new Promise((resolve, reject) => {
    const req = http.request(`${base}/api/v1${route}`, { method: 'POST', headers, agent }, (res) => {
      const chunks: Buffer[] = [];
      res.on('data', (c: Buffer) => chunks.push(c));
      res.on('error', reject);
      res.on('end', () => {
        const text = Buffer.concat(chunks).toString('utf8');
        if (res.statusCode !== 200) return reject(new Error(`${route}: ${res.statusCode} ${text}`));
        try {
          resolve(JSON.parse(text));
        } catch (e) {
          reject(new Error(`${route}: not JSON: ${text.slice(0, 200)} (${String(e)})`));
        }
      });
    });
    req.on('error', reject);
    req.end(payload);
  });
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
