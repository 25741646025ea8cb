import { spawn } from 'node:child_process';
import { createServer, request, type IncomingMessage, type ServerResponse } from 'node:http';
import type { AddressInfo } from 'node:net';
import path from 'node:path';
import { fileURLToPath } from 'node:url';

/**
 * The SDK's floor under bench/sdk_optim_step.py: the same script against a bare Node server that
 * answers `optim_step` and its `retrieve_future` at once, with nothing behind them (no Redis, no
 * engine, no broker), and the 404 itself. Everything else the script sends (the session, the model,
 * healthz) is passed through to the real server at `target`, unmeasured.
 *
 * What it shows: the SDK's own time for an optim_step (its two calls, its event loop thread, its
 * futures) against two bare round trips, on this machine: the ratio no server can go below. The
 * broker's share of the real figure is the difference.
 */
export type SdkFloor = { sdk_p50_ms: number; plain_404_p50_ms: number; ratio_404: number };

export async function sdkFloor(target: string, env: NodeJS.ProcessEnv, baseModel: string, steps: number): Promise<SdkFloor> {
  const to = new URL(target);
  let n = 0;
  const futures = new Set<string>();
  const send = (res: ServerResponse, status: number, body: unknown) => {
    const s = JSON.stringify(body);
    res.writeHead(status, { 'content-type': 'application/json; charset=utf-8', 'content-length': Buffer.byteLength(s) });
    res.end(s);
  };
  const server = createServer((req: IncomingMessage, res: ServerResponse) => {
    const chunks: Buffer[] = [];
    req.on('data', (c: Buffer) => chunks.push(c));
    req.on('end', () => {
      const body = Buffer.concat(chunks);
      if (req.url === '/no-such-path') return send(res, 404, { error: 'not found', code: 'NOT_FOUND' });
      if (req.method === 'POST' && req.url === '/api/v1/optim_step') {
        const id = `floor/${++n}`;
        futures.add(id);
        return send(res, 200, { request_id: id, model_id: (JSON.parse(body.toString()) as { model_id: string }).model_id });
      }
      if (req.method === 'POST' && req.url === '/api/v1/retrieve_future') {
        const id = (JSON.parse(body.toString()) as { request_id: string }).request_id;
        if (futures.delete(id)) return send(res, 200, { type: 'optim_step', metrics: {} });
      }
      const p = request({ host: to.hostname, port: to.port, path: req.url, method: req.method, headers: req.headers }, (r) => {
        res.writeHead(r.statusCode!, r.headers);
        r.pipe(res);
      });
      p.on('error', (e) => send(res, 502, { error: String(e) }));
      p.end(body);
    });
  });
  await new Promise<void>((r) => server.listen(0, '127.0.0.1', r));
  try {
    const url = `http://127.0.0.1:${(server.address() as AddressInfo).port}`;
    const script = fileURLToPath(new URL('./sdk_optim_step.py', import.meta.url));
    // Spawned, not run synchronously: this process answers the script's requests meanwhile.
    const out = await new Promise<string>((resolve, reject) => {
      const c = spawn(path.resolve('.venv/bin/python'), [script, baseModel, String(steps)], { env: { ...env, TINKER_BASE_URL: url } });
      let stdout = '';
      let stderr = '';
      c.stdout.on('data', (d: Buffer) => (stdout += d));
      c.stderr.on('data', (d: Buffer) => (stderr += d));
      c.on('error', reject);
      c.on('exit', (code) => (code === 0 ? resolve(stdout.trim().split('\n').pop()!) : reject(new Error(`sdk_optim_step.py failed (${code}):\n${stderr}`))));
    });
    const o = JSON.parse(out) as SdkFloor;
    return { sdk_p50_ms: o.sdk_p50_ms, plain_404_p50_ms: o.plain_404_p50_ms, ratio_404: o.ratio_404 };
  } finally {
    server.closeAllConnections();
    server.close();
  }
}
