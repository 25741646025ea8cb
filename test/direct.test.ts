import { createServer, type Server } from 'node:http';
import { expect } from 'chai';
import { TINY_MODEL_ALIAS } from '../scripts/stack.js';
import { API_KEY, awaitFuture, call, startStack, type HttpReply, type TestStack } from './helpers/stack.js';
import { encodeForwardBackward } from './helpers/wire.js';

/**
 * The hot routes served without Express's router (api/direct.ts) answer every request as Express
 * does: the same stack (one app, one context, one agent) is served twice, through its listener
 * (direct) and through Express alone, and each request gets the same status, body and headers from
 * both. And the listener does serve them directly: Express sees none of them.
 */
describe('direct routes', () => {
  let s: TestStack;
  let viaExpress: Server;
  let expressUrl: string;
  before(async () => {
    s = await startStack({ longPollMs: 2_000 });
    viaExpress = createServer(s.built.app);
    await new Promise<void>((r) => viaExpress.listen(0, '127.0.0.1', () => r()));
    expressUrl = `http://127.0.0.1:${(viaExpress.address() as { port: number }).port}`;
  });
  after(async () => {
    viaExpress?.closeAllConnections();
    await new Promise((r) => viaExpress?.close(r));
    await s?.stop();
  });

  /** What a client sees of a reply, but for the headers that differ between any two replies. */
  const seen = (r: HttpReply) => ({
    status: r.status,
    body: r.body.toString('utf8'),
    headers: Object.fromEntries([...r.headers.entries()].filter(([k]) => !['date', 'x-request-id', 'keep-alive', 'connection'].includes(k))),
  });

  /** How many requests Express's app handled while `fn` ran. */
  async function throughExpress(fn: () => Promise<unknown>): Promise<number> {
    let n = 0;
    const app = s.built.app as unknown as { handle: (...a: unknown[]) => unknown };
    const handle = app.handle;
    app.handle = function (this: unknown, ...a: unknown[]) {
      n++;
      return handle.apply(this, a);
    };
    try {
      await fn();
    } finally {
      app.handle = handle;
    }
    return n;
  }

  /** Sends the request to the listener, then to Express, and returns what the listener answered; Express must answer alike. */
  async function same(...args: Parameters<typeof call> extends [string, ...infer R] ? R : never): Promise<HttpReply> {
    let direct!: HttpReply;
    expect(await throughExpress(async () => (direct = await call(s.baseUrl, ...args))), `${args[0]} ${args[1]} went through Express`).to.equal(0);
    const viaApp = await call(expressUrl, ...args);
    expect(seen(direct), `${args[0]} ${args[1]}`).to.deep.equal(seen(viaApp));
    return direct;
  }

  it('answers the hot routes as Express does, valid requests and refusals alike, without Express', async () => {
    expect(s.built.ctx.config.apiKeys).to.include(API_KEY);
    const session = (await call(s.baseUrl, 'POST', '/create_session', { tags: [] })).json.session_id;
    const cm = await call(s.baseUrl, 'POST', '/create_model', { session_id: session, model_seq_id: 0, base_model: TINY_MODEL_ALIAS, lora_config: { rank: 4 } });
    const modelId = (await awaitFuture(s.baseUrl, cm.json.request_id)).json.model_id;
    const adam = { learning_rate: 1e-4, beta1: 0.9, beta2: 0.95, eps: 1e-12, weight_decay: 0, grad_clip_norm: 0 };
    const datum = { tokens: [1, 2, 3, 4], targets: [2, 3, 4, 5], weights: [1, 1, 1, 1] };

    // A submit, sent twice with the same seq_id: the same future both times.
    const fb = await same('POST', '/forward_backward', undefined, { raw: encodeForwardBackward({ modelId, seqId: 1, data: [datum] }) });
    expect(fb.status).to.equal(200);
    const os = await same('POST', '/optim_step', { model_id: modelId, seq_id: 2, adam_params: adam });
    expect(os.status).to.equal(200);
    // Its result (the first read may answer from memory, the second from Redis: the same answer).
    await awaitFuture(s.baseUrl, os.json.request_id);
    const done = await same('POST', '/retrieve_future', { request_id: os.json.request_id });
    expect(done.json).to.have.property('type', 'optim_step');

    // Refusals, each in the Tinker error shape.
    const refusals: [string, HttpReply][] = [
      ['no key', await same('POST', '/optim_step', { model_id: modelId, seq_id: 3, adam_params: adam }, { key: null })],
      ['a wrong key', await same('POST', '/retrieve_future', { request_id: os.json.request_id }, { key: 'tml-nobody' })],
      ['malformed JSON', await same('POST', '/optim_step', '{"model_id":', {})],
      ['a bare value', await same('POST', '/asample', '42', {})],
      ['a missing field', await same('POST', '/optim_step', { model_id: modelId, adam_params: adam })],
      ['an unknown model', await same('POST', '/optim_step', { model_id: 'nope:train:0', seq_id: 1, adam_params: adam })],
      ['an unknown future', await same('POST', '/retrieve_future', { request_id: 'train-x/t-nothing-1' })],
      ['an unknown sampler', await same('POST', '/asample', { sampling_session_id: 'nope', seq_id: 1, num_samples: 1, prompt: { chunks: [] }, sampling_params: {} })],
      ['a body that is not protobuf', await same('POST', '/forward_backward', undefined, { raw: Buffer.from('not a protobuf') })],
      ['an unsupported charset', await same('POST', '/optim_step', '{}', { contentType: 'application/json; charset=latin1' })],
    ];
    for (const [what, r] of refusals) {
      expect(r.status, what).to.be.within(400, 499);
      expect(r.json, what).to.have.keys('error', 'category', 'code');
    }
  });

  it('leaves other requests to Express: other paths, methods and query strings', async () => {
    const n = await throughExpress(async () => {
      expect((await call(s.baseUrl, 'POST', '/retrieve_future?x=1', { request_id: 'train-x/t-nothing-1' })).status).to.equal(404);
      expect((await call(s.baseUrl, 'GET', '/optim_step')).status).to.equal(404);
      expect((await call(s.baseUrl, 'POST', '/create_session', { tags: [] })).status).to.equal(200);
    });
    expect(n).to.equal(3);
  });
});
