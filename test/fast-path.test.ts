import { expect } from 'chai';
import type { Redis } from 'ioredis';
import { TINY_MODEL_ALIAS } from '../scripts/stack.js';
import { awaitFuture, call, startStack, type TestStack } from './helpers/stack.js';
import { encodeForwardBackward } from './helpers/wire.js';

/**
 * The submit of a training op is at most 3 Redis round trips (issue 10): the route reads the model,
 * one script admits the op and, in order, queues it with its owner record. Counted on the API's own
 * connection with a real agent and Redis; each submit is made 5 times (new seq_ids) and the fewest
 * commands taken, so a reaper sweep that happens to overlap one request cannot inflate the count.
 */
describe('fast path', () => {
  let s: TestStack;
  before(async () => {
    s = await startStack({ longPollMs: 5_000 });
  });
  after(async () => s?.stop());

  /** Redis commands the API sends while `fn` runs. */
  async function commands(fn: () => Promise<unknown>): Promise<string[]> {
    const redis = s.built.ctx.redis as Redis & { sendCommand: (c: { name: string; args: unknown[] }) => unknown };
    const seen: string[] = [];
    const orig = redis.sendCommand;
    redis.sendCommand = function (this: Redis, c: { name: string; args: unknown[] }) {
      seen.push(`${c.name} ${String(c.args[0] ?? '')}`);
      return orig.call(this, c as never);
    } as typeof redis.sendCommand;
    try {
      await fn();
    } finally {
      redis.sendCommand = orig;
    }
    return seen;
  }

  it('submits forward_backward and optim_step in at most 3 Redis round trips each', async () => {
    const session = (await call(s.baseUrl, 'POST', '/create_session', { tags: [] })).json.session_id;
    const cm = await call(s.baseUrl, 'POST', '/create_model', { session_id: session, model_seq_id: 0, base_model: TINY_MODEL_ALIAS, lora_config: { rank: 4 } });
    const modelId = (await awaitFuture(s.baseUrl, cm.json.request_id)).json.model_id;
    const adam = { learning_rate: 1e-4, beta1: 0.9, beta2: 0.95, eps: 1e-12, weight_decay: 0, grad_clip_norm: 0 };
    const datum = { tokens: [1, 2, 3, 4], targets: [2, 3, 4, 5], weights: [1, 1, 1, 1] };
    let seq = 1;
    const counts: Record<string, string[]> = {};
    for (let i = 0; i < 5; i++) {
      for (const op of ['forward_backward', 'optim_step'] as const) {
        const seqId = seq++;
        let requestId = '';
        const seen = await commands(async () => {
          const r =
            op === 'forward_backward'
              ? await call(s.baseUrl, 'POST', '/forward_backward', undefined, { raw: encodeForwardBackward({ modelId, seqId, data: [datum] }) })
              : await call(s.baseUrl, 'POST', '/optim_step', { model_id: modelId, seq_id: seqId, adam_params: adam });
          expect(r.status, JSON.stringify(r.json)).to.equal(200);
          requestId = r.json.request_id;
        });
        if (!counts[op] || seen.length < counts[op]!.length) counts[op] = seen;
        // Each op runs and answers before the next is sent.
        const done = await awaitFuture(s.baseUrl, requestId);
        expect(done.json.error, JSON.stringify(done.json)).to.equal(undefined);
      }
    }
    for (const op of ['forward_backward', 'optim_step']) expect(counts[op]!.length, `${op}: ${counts[op]!.join(', ')}`).to.be.at.most(3);
  });
});
