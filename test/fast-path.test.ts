import { expect } from 'chai';
import { Redis as RedisClient, type Redis } from 'ioredis';
import { tenantId } from '../api/auth.js';
import { encodeRequestId } from '../queues/futures.js';
import { Names } from '../queues/names.js';
import { Outcomes, SIGNALLED_RECORD_MAX_BYTES } from '../queues/outcomes.js';
import { TINY_MODEL_ALIAS } from '../scripts/stack.js';
import { API_KEY, API_KEY_B, awaitFuture, call, REDIS_URL, startStack, type TestStack } from './helpers/stack.js';
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

/**
 * The answer of a training op's future (issue 10: completion signalled, not polled, and no hop
 * more than needed): while a retrieve_future waits, the API reads the future once (one script that
 * also checks its owner); the completion signal carries the final record, so the answer needs no
 * read back, and the read-once expiry follows it. A record too large for the signal is read back.
 */
describe('fast path: a training op answered from its completion signal', () => {
  let s: TestStack;
  let other: Redis;
  before(async () => {
    s = await startStack({ agent: false, longPollMs: 5_000 });
    other = new RedisClient(REDIS_URL);
  });
  after(async () => {
    other?.disconnect();
    await s?.stop();
  });

  for (const [what, size, reads] of [
    ['a small record, from the signal', 16, 1],
    ['a record too large for the signal, read back', SIGNALLED_RECORD_MAX_BYTES, 2],
  ] as const) {
    it(`answers with ${what}`, async () => {
      const ctx = s.built.ctx;
      const names = new Names(s.prefix);
      const tenant = tenantId(API_KEY);
      const jobId = `t-fastpath${size}-1`;
      const requestId = encodeRequestId({ queue: 'train-agent-fastpath', jobId });
      await ctx.registry.futures.setOwner(requestId, tenant, 600);
      // Its job, queued and not finished: the future is pending.
      await other.hset(ctx.queues.jobKey('train-agent-fastpath', jobId), 'name', 'optim_step');
      const result = { metrics: {}, pad: 'x'.repeat(size) };
      const redis = ctx.redis as Redis & { sendCommand: (c: { name: string; args: unknown[] }) => unknown };
      const seen: string[] = [];
      const orig = redis.sendCommand;
      redis.sendCommand = function (this: Redis, c: { name: string; args: unknown[] }) {
        seen.push(`${c.name} ${c.args.map(String).join(' ').slice(0, 300)}`);
        return orig.call(this, c as never);
      } as typeof redis.sendCommand;
      try {
        const answer = ctx.futures.retrieve(requestId, tenant, 5_000);
        await new Promise((r) => setTimeout(r, 200));
        // The agent's finish, on a connection of its own.
        await new Outcomes(other, names, 3_600).finish(jobId, '', { state: 'done', op: 'optim_step', agent_id: 'agent-fastpath', result });
        const st = await answer;
        expect(st.kind).to.equal('done');
        expect((st as { result: unknown }).result).to.deep.equal(result);
      } finally {
        redis.sendCommand = orig;
      }
      const scripts = seen.filter((c) => /^evalsha /.test(c) && c.includes(jobId));
      expect(scripts.length, seen.join('\n')).to.equal(reads);
      expect(seen.filter((c) => c.startsWith('get ') && c.includes('future-owner')), 'the owner is checked inside the read').to.deep.equal([]);
      // Read once: the record leaves soon (the expiry follows the answer).
      for (let i = 0; i < 50 && (await other.pttl(names.outcome(jobId))) > 300_000; i++) await new Promise((r) => setTimeout(r, 20));
      expect(await other.pttl(names.outcome(jobId))).to.be.within(1, 300_000);
    });
  }

  it("reads another tenant's training future as unknown, and leaves its records as they were", async () => {
    const ctx = s.built.ctx;
    const names = new Names(s.prefix);
    const jobId = 't-fastpathother-1';
    const requestId = encodeRequestId({ queue: 'train-agent-fastpath', jobId });
    await ctx.registry.futures.setOwner(requestId, tenantId(API_KEY), 600);
    await new Outcomes(other, names, 3_600).finish(jobId, '', { state: 'done', op: 'optim_step', agent_id: 'agent-fastpath', result: { metrics: {} } });
    expect((await ctx.futures.retrieve(requestId, tenantId(API_KEY_B), 1_000)).kind).to.equal('unknown');
    expect(await other.pttl(names.outcome(jobId))).to.be.above(300_000);
    expect((await ctx.futures.retrieve(requestId, tenantId(API_KEY), 1_000)).kind).to.equal('done');
  });
});
