import { spawn, type ChildProcess } from 'node:child_process';
import { createServer } from 'node:net';
import { expect } from 'chai';
import express from 'express';
import { Redis } from 'ioredis';
import { errorHandler } from '../api/errors.js';
import { call, startStack, type HttpReply, type TestStack } from './helpers/stack.js';

/** A Redis of the test's own (it is killed for real), on a free port. */
async function freePort(): Promise<number> {
  return new Promise((resolve) => {
    const srv = createServer();
    srv.listen(0, '127.0.0.1', () => {
      const p = (srv.address() as { port: number }).port;
      srv.close(() => resolve(p));
    });
  });
}

function startRedis(port: number): Promise<ChildProcess> {
  return new Promise((resolve, reject) => {
    const p = spawn('redis-server', ['--port', String(port), '--bind', '127.0.0.1', '--save', '', '--appendonly', 'no'], { stdio: ['ignore', 'pipe', 'inherit'] });
    p.stdout!.on('data', (d: Buffer) => {
      if (d.toString().includes('Ready to accept connections')) resolve(p);
    });
    p.on('error', reject);
  });
}

/**
 * While Redis is unreachable every route answers 503 with Retry-After (the SDK retries a 503
 * with backoff) instead of a 500 or a hang; when it is back, the same API serves again.
 */
describe('Redis outage', function () {
  this.timeout(60_000);
  let port: number;
  let redis: ChildProcess | null = null;
  let s: TestStack;

  before(async () => {
    port = await freePort();
    redis = await startRedis(port);
    s = await startStack({ agent: false, longPollMs: 500, redisUrl: `redis://127.0.0.1:${port}` });
  });
  after(async () => {
    redis?.kill('SIGKILL');
    await s?.stop().catch(() => undefined);
  });

  it('answers 503 with Retry-After on every route while Redis is down, and serves again once it is back', async () => {
    const sess = await call(s.baseUrl, 'POST', '/create_session', { tags: [] });
    expect(sess.status).to.equal(200);
    const sessionId = sess.json.session_id as string;
    const routes: [string, string, unknown?][] = [
      ['POST', '/create_session', { tags: [] }],
      ['POST', '/session_heartbeat', { session_id: sessionId }],
      ['POST', '/create_model', { session_id: sessionId, model_seq_id: 0, base_model: 'm', lora_config: { rank: 2 } }],
      ['POST', '/get_info', { model_id: `${sessionId}:train:0` }],
      ['POST', '/optim_step', { model_id: `${sessionId}:train:0`, seq_id: 1, adam_params: {} }],
      ['POST', '/asample', { prompt: { chunks: [] }, sampling_params: {}, base_model: 'm' }],
      ['POST', '/retrieve_future', { request_id: 'train-a/t-abc-1' }],
      ['GET', '/training_runs'],
      ['GET', '/checkpoints'],
      ['GET', `/sessions/${sessionId}`],
      ['POST', '/weights_info', { tinker_path: 'tinker://a:train:0/weights/w' }],
      ['GET', '/get_server_capabilities'],
      ['GET', '/healthz'],
    ];
    redis!.kill('SIGKILL');
    await new Promise((r) => redis!.once('exit', r));
    redis = null;
    const check = (r: HttpReply, what: string) => {
      expect(r.status, `${what}: ${JSON.stringify(r.json)}`).to.equal(503);
      expect(r.headers.get('retry-after'), what).to.equal('2');
      expect(r.json).to.include({ category: 'server', code: 'UNAVAILABLE' });
    };
    for (const [method, route, body] of routes) {
      const t0 = Date.now();
      check(await call(s.baseUrl, method as 'GET', route, body), `${method} ${route}`);
      expect(Date.now() - t0, `${method} ${route} answered at once`).to.be.below(1_000);
    }
    const h = await fetch(`${s.baseUrl}/healthz`);
    expect(h.status).to.equal(503);
    expect(h.headers.get('retry-after')).to.equal('2');

    redis = await startRedis(port);
    const t0 = Date.now();
    let back: HttpReply | null = null;
    while (Date.now() - t0 < 15_000) {
      back = await call(s.baseUrl, 'POST', '/create_session', { tags: [] });
      if (back.status === 200) break;
      check(back, 'while reconnecting');
      await new Promise((r) => setTimeout(r, 200));
    }
    expect(back?.status).to.equal(200);
  });

  it('maps the errors of a command that gave up on an unreachable Redis to 503, wherever they are raised', async () => {
    const dead = await freePort();
    const errors: unknown[] = [];
    for (const opts of [{ maxRetriesPerRequest: 1 }, { enableOfflineQueue: false }]) {
      const c = new Redis(`redis://127.0.0.1:${dead}`, { ...opts, retryStrategy: () => 50 });
      c.on('error', () => undefined);
      errors.push(await c.get('x').then(() => null, (e: unknown) => e));
      c.disconnect();
    }
    const app = express();
    app.get('/e/:i', (req) => {
      throw errors[Number(req.params.i)];
    });
    app.use(errorHandler);
    const srv = app.listen(0, '127.0.0.1');
    await new Promise((r) => srv.once('listening', r));
    try {
      const port = (srv.address() as { port: number }).port;
      for (let i = 0; i < errors.length; i++) {
        expect(errors[i], `case ${i}`).to.be.instanceOf(Error);
        const r = await fetch(`http://127.0.0.1:${port}/e/${i}`);
        expect(r.status, `${String(errors[i])}`).to.equal(503);
        expect(r.headers.get('retry-after')).to.equal('2');
        expect(await r.json()).to.include({ category: 'server', code: 'UNAVAILABLE' });
      }
    } finally {
      srv.close();
    }
  });
});
