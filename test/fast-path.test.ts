import http from 'node:http';
import { expect } from 'chai';
import { Redis as RedisClient, type Redis } from 'ioredis';
import { tenantId } from '../api/auth.js';
import { decodeRequestId, encodeRequestId } from '../queues/contract/futures.js';
import { Names } from '../queues/contract/names.js';
import { Completions, expectHandOver, handOverDone, KEPT_RECORD_MS, KEPT_RECORDS_MAX, keepHandedOver, sampleEndSignal, signalLocally, signalMessage, takeKept } from '../queues/runtime/completions.js';
import { Outcomes, SIGNALLED_RECORD_MAX_BYTES } from '../queues/runtime/outcomes.js';
import { TINY_MODEL_ALIAS } from '../scripts/stack.js';
import { API_KEY, API_KEY_B, awaitFuture, call, REDIS_URL, startStack, type TestStack } from './helpers/stack.js';
import { encodeForwardBackward } from './helpers/wire.js';
import { EngineProcess } from '../workers/engine.js';
import { localTrainConsumer, type TrainConsumer } from '../queues/runtime/train-consumer.js';

/** Redis commands the API of `s` sends while `fn` runs. */
async function commands(s: TestStack, fn: () => Promise<unknown>): Promise<string[]> {
  const redis = s.built.ctx.redis as Redis & { sendCommand: (c: { name: string; args: unknown[] }) => unknown };
  const seen: string[] = [];
  const orig = redis.sendCommand;
  redis.sendCommand = function (this: Redis, c: { name: string; args: unknown[] }) {
    seen.push(`${c.name} ${c.args.map(String).join(' ').slice(0, 500)}`);
    return orig.call(this, c as never);
  } as typeof redis.sendCommand;
  try {
    await fn();
  } finally {
    redis.sendCommand = orig;
  }
  return seen;
}

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
        const seen = await commands(s, async () => {
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

  it("answers an optim_step it hands to its own agent before the engine is called, and calls the engine first for a forward_backward", async () => {
    const session = (await call(s.baseUrl, 'POST', '/create_session', { tags: [] })).json.session_id;
    const cm = await call(s.baseUrl, 'POST', '/create_model', { session_id: session, model_seq_id: 0, base_model: TINY_MODEL_ALIAS, lora_config: { rank: 4 } });
    const modelId = (await awaitFuture(s.baseUrl, cm.json.request_id)).json.model_id;
    const events: string[] = [];
    const end = http.ServerResponse.prototype.end;
    const engineCall = EngineProcess.prototype.call;
    http.ServerResponse.prototype.end = function (this: http.ServerResponse, ...a: unknown[]) {
      events.push(`answer ${(this.req as { originalUrl?: string }).originalUrl}`);
      return (end as (...x: unknown[]) => http.ServerResponse).apply(this, a);
    } as typeof end;
    EngineProcess.prototype.call = function (this: EngineProcess, op: string, args: unknown) {
      events.push(`engine ${op}`);
      return (engineCall as (o: string, x: unknown) => Promise<unknown>).call(this, op, args);
    } as typeof engineCall;
    try {
      const adam = { learning_rate: 1e-4, beta1: 0.9, beta2: 0.95, eps: 1e-12, weight_decay: 0, grad_clip_norm: 0 };
      const datum = { tokens: [1, 2, 3, 4], targets: [2, 3, 4, 5], weights: [1, 1, 1, 1] };
      for (let seqId = 1; seqId <= 4; seqId++) {
        const r =
          seqId % 2 === 1
            ? await call(s.baseUrl, 'POST', '/forward_backward', undefined, { raw: encodeForwardBackward({ modelId, seqId, data: [datum] }) })
            : await call(s.baseUrl, 'POST', '/optim_step', { model_id: modelId, seq_id: seqId, adam_params: adam });
        expect(r.status, JSON.stringify(r.json)).to.equal(200);
        expect((await awaitFuture(s.baseUrl, r.json.request_id)).json.error).to.equal(undefined);
      }
    } finally {
      http.ServerResponse.prototype.end = end;
      EngineProcess.prototype.call = engineCall;
    }
    const relevant = events.filter((e) => /^answer \/api\/v1\/(optim_step|forward_backward)$|^engine (optim_step|forward_backward)$/.test(e));
    const pair = ['engine forward_backward', 'answer /api/v1/forward_backward', 'answer /api/v1/optim_step', 'engine optim_step'];
    expect(relevant).to.deep.equal([...pair, ...pair]);
  });

  it("answers the future of an op its own agent runs without reading Redis, and another tenant's from Redis", async () => {
    const session = (await call(s.baseUrl, 'POST', '/create_session', { tags: [] })).json.session_id;
    const cm = await call(s.baseUrl, 'POST', '/create_model', { session_id: session, model_seq_id: 0, base_model: TINY_MODEL_ALIAS, lora_config: { rank: 4 } });
    const modelId = (await awaitFuture(s.baseUrl, cm.json.request_id)).json.model_id;
    const datum = { tokens: [1, 2, 3, 4], targets: [2, 3, 4, 5], weights: [1, 1, 1, 1] };
    const names = new Names(s.prefix);
    const reaped = names.agentReaped(`agent-${s.prefix}`);
    // Whether each submit handed its op to the agent here: one made while the agent's own take is in
    // flight (it has just ended an op) leaves the op to that take, and its future is read from Redis.
    const consumer = localTrainConsumer(`${names.bull}:train-agent-${s.prefix}:`)!;
    const handOff = consumer.handOff;
    let handed = 0;
    consumer.handOff = function (this: TrainConsumer) {
      const h = handOff.call(this);
      if (h) handed++;
      return h;
    };
    let fast = 0;
    try {
      for (let seqId = 1; seqId <= 5; seqId++) {
        const before = handed;
        const r = await call(s.baseUrl, 'POST', '/forward_backward', undefined, { raw: encodeForwardBackward({ modelId, seqId, data: [datum] }) });
        expect(r.status, JSON.stringify(r.json)).to.equal(200);
        const wasHanded = handed > before;
        // Another tenant asks first: it reads Redis (the future's owner) and finds nothing of its own.
        expect((await s.built.ctx.futures.retrieve(r.json.request_id, tenantId(API_KEY_B), 10)).kind).to.equal('unknown');
        let st: { kind: string; result?: { loss_fn_outputs: unknown[] } } | undefined;
        const seen = await commands(s, async () => (st = (await s.built.ctx.futures.retrieve(r.json.request_id, tenantId(API_KEY), 30_000)) as typeof st));
        expect(st?.kind, JSON.stringify(st)).to.equal('done');
        expect(st!.result!.loss_fn_outputs).to.have.length(1);
        if (!wasHanded) continue;
        fast++;
        // No read of the future (its script names the agent's reaped key); the record's own script may follow.
        expect(seen.filter((c) => c.includes(reaped)), seen.join(', ')).to.deep.equal([]);
      }
    } finally {
      consumer.handOff = handOff;
    }
    expect(fast, 'submits that handed their op to the agent here').to.be.at.least(2);
  });

  /**
   * A sample request: asample reads the sampling session and the live agents (routing), then one
   * script admits it (queue bound, job, owner, the session's lifetime, the replay check); its
   * retrieve_future, through the API that submitted it for the same tenant, reads nothing: its
   * end's completion signal answers it (the waiter's, or the record kept here when the sample ended
   * first), and the read-once expiry is set after answering.
   */
  it('submits a sample in at most 3 Redis round trips and answers it from its completion signal without reading its state', async () => {
    const session = (await call(s.baseUrl, 'POST', '/create_session', { tags: [] })).json.session_id;
    const sc = await call(s.baseUrl, 'POST', '/create_sampling_session', { session_id: session, sampling_session_seq_id: 0, base_model: TINY_MODEL_ALIAS });
    const samplingSessionId = sc.json.sampling_session_id as string;
    let submit: string[] | undefined;
    let signalled = 0;
    for (let seqId = 0; seqId < 5; seqId++) {
      let requestId = '';
      const sub = await commands(s, async () => {
        const r = await call(s.baseUrl, 'POST', '/asample', {
          prompt: { chunks: [{ type: 'encoded_text', tokens: [5, 17, 42, 99] }] },
          num_samples: 1,
          sampling_params: { max_tokens: 64, temperature: 1, seed: seqId, stop: [] },
          sampling_session_id: samplingSessionId,
          seq_id: seqId,
        });
        expect(r.status, JSON.stringify(r.json)).to.equal(200);
        requestId = r.json.request_id;
      });
      if (!submit || sub.length < submit.length) submit = sub;
      const tenant = tenantId(API_KEY);
      const ret = await commands(s, async () => {
        const st = await s.built.ctx.futures.retrieve(requestId, tenant, 5_000);
        expect(st.kind, JSON.stringify(st)).to.equal('done');
        expect((st as { result: { sequences: unknown[] } }).result.sequences).to.have.length(1);
        // The read-once expiry follows an answer from the signal.
        await new Promise((r) => setTimeout(r, 50));
      });
      // No read (the future-sample script), whether the sample had finished before it or not; no read of the job back.
      const jobId = decodeRequestId(requestId)!.jobId;
      expect(ret.filter((c) => c.startsWith('evalsha ') && c.includes(jobId)), ret.join(', ')).to.deep.equal([]);
      // (The liveness sweep of this process may read the agents meanwhile.)
      expect(ret.filter((c) => /^(hgetall|hget|hmget|get) /i.test(c) && /sample-|future-owner/.test(c)), ret.join(', ')).to.deep.equal([]);
      // Answered from the signal: the expiry set after the answer.
      if (ret.some((c) => /^pexpire /i.test(c) && c.includes(jobId))) signalled++;
    }
    expect(submit!.length, submit!.join(', ')).to.be.at.most(3);
    expect(signalled, 'every answer from the completion signal sets the read-once expiry').to.equal(5);
  });
});

describe('fast path: the completion signal of a sample', () => {
  it('carries the result when it is small, the job id alone when it is not', () => {
    const names = new Names('tb-signal');
    const [channel, small] = sampleEndSignal(names, 's-abc-1', 'agent-x', { state: 'done', result: { sequences: [{ tokens: [1, 2] }] } });
    expect(channel).to.equal(names.outcomesChannel());
    const record = JSON.parse(small.slice('s-abc-1 '.length));
    expect(record).to.include({ state: 'done', op: 'sample' });
    expect(record.result).to.deep.equal({ sequences: [{ tokens: [1, 2] }] });
    const [, failed] = sampleEndSignal(names, 's-abc-2', 'agent-x', { state: 'failed', code: 'INVALID_REQUEST', category: 'user', message: 'bad' });
    expect(JSON.parse(failed.slice('s-abc-2 '.length))).to.include({ state: 'failed', code: 'INVALID_REQUEST', category: 'user', message: 'bad' });
    const [, large] = sampleEndSignal(names, 's-abc-3', 'agent-x', { state: 'done', result: { pad: 'x'.repeat(SIGNALLED_RECORD_MAX_BYTES) } });
    expect(large).to.equal('s-abc-3');
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
      const seen = await commands(s, async () => {
        const answer = ctx.futures.retrieve(requestId, tenant, 5_000);
        await new Promise((r) => setTimeout(r, 200));
        // The agent's finish, on a connection of its own.
        await new Outcomes(other, names, 3_600).finish(jobId, '', { state: 'done', op: 'optim_step', agent_id: 'agent-fastpath', result });
        const st = await answer;
        expect(st.kind).to.equal('done');
        expect((st as { result: unknown }).result).to.deep.equal(result);
      });
      const scripts = seen.filter((c) => /^evalsha /.test(c) && c.includes(jobId));
      expect(scripts.length, seen.join('\n')).to.equal(reads);
      expect(seen.filter((c) => c.startsWith('get ') && c.includes('future-owner')), 'the owner is checked inside the read').to.deep.equal([]);
      // Read once: the record leaves soon (the expiry follows the answer).
      for (let i = 0; i < 50 && (await other.pttl(names.outcome(jobId))) > 300_000; i++) await new Promise((r) => setTimeout(r, 20));
      expect(await other.pttl(names.outcome(jobId))).to.be.within(1, 300_000);
    });
  }

  it("reads another tenant's sample future as unknown, and leaves its job as it was", async () => {
    const ctx = s.built.ctx;
    const jobId = 's-fastpathother-1';
    const queue = 'sample-fastpath-torch';
    const requestId = encodeRequestId({ queue, jobId });
    await ctx.registry.futures.setOwner(requestId, tenantId(API_KEY), 600);
    // A finished job (BullMQ's fields as its worker leaves them).
    await other.hset(ctx.queues.jobKey(queue, jobId), 'name', 'sample', 'finishedOn', String(Date.now()), 'returnvalue', JSON.stringify({ sequences: [] }));
    expect((await ctx.futures.retrieve(requestId, tenantId(API_KEY_B), 1_000)).kind).to.equal('unknown');
    expect(await other.pttl(ctx.queues.jobKey(queue, jobId))).to.equal(-1);
    const mine = await ctx.futures.retrieve(requestId, tenantId(API_KEY), 1_000);
    expect(mine).to.deep.include({ kind: 'done', result: { sequences: [] } });
    expect(await other.pttl(ctx.queues.jobKey(queue, jobId))).to.be.within(1, 300_000);
  });

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

  /** A training future of this tenant, pending (its job queued), and its retrieve_future waiting. */
  async function waitingFuture(jobId: string): Promise<{ answer: Promise<unknown> }> {
    const ctx = s.built.ctx;
    const tenant = tenantId(API_KEY);
    const requestId = encodeRequestId({ queue: 'train-agent-fastpath', jobId });
    await ctx.registry.futures.setOwner(requestId, tenant, 600);
    await other.hset(ctx.queues.jobKey('train-agent-fastpath', jobId), 'name', 'optim_step');
    const answer = ctx.futures.retrieve(requestId, tenant, 5_000);
    await new Promise((r) => setTimeout(r, 200));
    return { answer };
  }

  const doneRecord = (metrics: Record<string, number>) =>
    JSON.stringify({ state: 'done', op: 'optim_step', agent_id: 'agent-fastpath', token: 'x', at: new Date().toISOString(), result: { metrics } });
  const within = (p: Promise<unknown>, what: string) => Promise.race([p, new Promise<never>((_, rej) => setTimeout(() => rej(new Error(what)), 1_000))]);

  it('answers from a signal handed over in this process (an agent beside the API) before any message comes from Redis', async () => {
    const names = new Names(s.prefix);
    const jobId = 't-fastpathlocal-1';
    const { answer } = await waitingFuture(jobId);
    const record = doneRecord({ local: 1 });
    // Another deployment's channel wakes nothing here; this one's answers at once (nothing stored, nothing published).
    signalLocally(new Names(`${s.prefix}-other`).outcomesChannel(), signalMessage(jobId, record));
    const early = await Promise.race([answer.then(() => 'answered'), new Promise((r) => setTimeout(() => r('waiting'), 100))]);
    expect(early).to.equal('waiting');
    signalLocally(names.outcomesChannel(), signalMessage(jobId, record));
    expect(await within(answer, 'not answered from the local signal')).to.deep.include({ kind: 'done', result: { metrics: { local: 1 } } });
  });

  it("wakes a waiter on an op this process's agent let go without handing it over, to read Redis", async () => {
    const names = new Names(s.prefix);
    const jobId = 't-fastpathletgo-1';
    expectHandOver(names.outcomesChannel(), jobId, tenantId(API_KEY));
    const { answer } = await waitingFuture(jobId);
    // Recorded elsewhere (a reaper, say), not published: only the agent letting the op go wakes the waiter.
    await other.set(names.outcome(jobId), doneRecord({ elsewhere: 1 }), 'EX', 600);
    const early = await Promise.race([answer.then(() => 'answered'), new Promise((r) => setTimeout(() => r('waiting'), 200))]);
    expect(early).to.equal('waiting');
    handOverDone(names.outcomesChannel(), jobId);
    expect(await within(answer, 'not woken when the agent let the op go')).to.deep.include({ kind: 'done', result: { metrics: { elsewhere: 1 } } });
  });

  it("sends no message back to the process whose waiters it handed the record to, unless another process listens", async () => {
    const names = new Names(s.prefix);
    const channel = names.outcomesChannel();
    // A pattern subscription sees every message and is not counted as one of the channel's subscribers.
    const observer = new RedisClient(REDIS_URL);
    const listener = new RedisClient(REDIS_URL);
    const messages: string[] = [];
    const heard: string[] = [];
    try {
      observer.on('pmessage', (_p: string, _c: string, m: string) => messages.push(m.split(' ')[0]!));
      await observer.psubscribe(channel);
      const finishEarly = async (jobId: string) => {
        const { answer } = await waitingFuture(jobId);
        await new Outcomes(other, names, 3_600).finish(jobId, '', { state: 'done', op: 'optim_step', agent_id: 'agent-fastpath', result: { metrics: {} } }, true);
        expect(await within(answer, 'not answered')).to.deep.include({ kind: 'done' });
      };
      await finishEarly('t-fastpathquiet-1');
      // Another API process listening: it gets the message.
      listener.on('message', (_c: string, m: string) => heard.push(m.split(' ')[0]!));
      await listener.subscribe(channel);
      await finishEarly('t-fastpathquiet-2');
      // A record not handed over here (the reaper's) always goes out.
      await new Outcomes(other, names, 3_600).failUnknown('t-fastpathquiet-3', 'optim_step', 'agent-fastpath', 'reaped');
      for (let i = 0; i < 50 && messages.length < 2; i++) await new Promise((r) => setTimeout(r, 20));
      await new Promise((r) => setTimeout(r, 50));
      expect(messages).to.deep.equal(['t-fastpathquiet-2', 't-fastpathquiet-3']);
      expect(heard).to.deep.equal(['t-fastpathquiet-2', 't-fastpathquiet-3']);
    } finally {
      observer.disconnect();
      listener.disconnect();
    }
  });

  for (const when of ['recorded', 'on its way to Redis', 'handed over while another tenant waited'] as const)
    it(`answers an op this process's agent ended before its client asked (${when}) from the record kept here, once, for its own tenant`, async () => {
      const ctx = s.built.ctx;
      const names = new Names(s.prefix);
      const tenant = tenantId(API_KEY);
      const jobId = `t-fastpathkept-${['recorded', 'on its way to Redis', 'handed over while another tenant waited'].indexOf(when) + 1}`;
      const requestId = encodeRequestId({ queue: 'train-agent-fastpath', jobId });
      await ctx.registry.futures.setOwner(requestId, tenant, 600);
      await other.hset(ctx.queues.jobKey('train-agent-fastpath', jobId), 'name', 'optim_step');
      const reads = async (who: string) => {
        const seen = await commands(s, async () =>
          expect(await ctx.futures.retrieve(requestId, who, 1_000)).to.deep.include(who === tenant ? { kind: 'done', result: { metrics: { kept: 1 } } } : { kind: 'unknown' }),
        );
        return seen.filter((c) => c.startsWith('evalsha ') && c.includes(jobId)).length;
      };
      // A submit here handed the op to this process's agent, which ran it and hands it over with no one waiting.
      expectHandOver(names.outcomesChannel(), jobId, tenant);
      // Or with another tenant's retrieve_future waiting here (its read of Redis in flight): woken, it
      // answers unknown, and the record stays kept for the owner (CI once saw the owner read Redis).
      const stranger = when === 'handed over while another tenant waited' ? new Completions(() => new RedisClient(REDIS_URL), names) : undefined;
      const watching = await stranger?.watch({ queue: 'train-agent-fastpath', jobId }, tenantId(API_KEY_B));
      const recorded = new Outcomes(other, names, 3_600).finish(jobId, 'x', { state: 'done', op: 'optim_step', agent_id: 'agent-fastpath', result: { metrics: { kept: 1 } } }, true);
      if (watching) {
        expect(await within(watching.woken, 'the stranger was not woken')).to.have.property('record');
        watching.cancel();
        await stranger!.close();
        // Its waiter applied no read-once expiry: the record keeps its lifetime until its owner reads it.
        await recorded;
        expect(await other.pttl(names.outcome(jobId))).to.be.above(300_000);
      }
      if (when === 'recorded') {
        await recorded;
        // Another tenant reads Redis, finds nothing of its own, and leaves the record kept for its owner.
        expect(await reads(tenantId(API_KEY_B))).to.equal(1);
        expect(await other.pttl(names.outcome(jobId))).to.be.above(300_000);
      }
      // The owner's first read answers from here; the read-once expiry follows the answer, and the record's own write.
      expect(await reads(tenant)).to.equal(0);
      await recorded;
      for (let i = 0; i < 50 && (await other.pttl(names.outcome(jobId))) > 300_000; i++) await new Promise((r) => setTimeout(r, 20));
      expect(JSON.parse((await other.get(names.outcome(jobId)))!)).to.deep.include({ state: 'done', result: { metrics: { kept: 1 } } });
      for (const key of [names.outcome(jobId), ctx.queues.jobKey('train-agent-fastpath', jobId), names.futureOwner(requestId)])
        expect(await other.pttl(key), key).to.be.within(1, 300_000);
      // A second read (a client's retry) reads Redis, which holds the same record.
      expect(await reads(tenant)).to.equal(1);
    });

  it('keeps an op handed over for its first read for a while, and the newest ones only', () => {
    const channel = new Names(`${s.prefix}-kept`).outcomesChannel();
    const rec = (i: number) => ({ state: 'done' as const, op: 'optim_step', agent_id: 'a', token: 't', at: 'now', result: { i } });
    const t0 = 1_000_000;
    const keep = (jobId: string, i: number) => keepHandedOver(channel, jobId, 'k1', rec(i), Promise.resolve(), t0);
    keep('t-old-1', 0);
    expect(takeKept(channel, 't-old-1', 'k1', t0 + KEPT_RECORD_MS)).to.equal(undefined);
    for (let i = 0; i <= KEPT_RECORDS_MAX; i++) keep(`t-many-${i}`, i);
    expect(takeKept(channel, 't-many-0', 'k1', t0), 'the oldest past the bound').to.equal(undefined);
    expect(takeKept(channel, 't-many-1', 'k2', t0), 'another tenant').to.equal(undefined);
    expect(takeKept(channel, 't-many-1', 'k1', t0)?.record).to.deep.include({ result: { i: 1 } });
    expect(takeKept(channel, 't-many-1', 'k1', t0), 'taken once').to.equal(undefined);
    expect(takeKept(channel, `t-many-${KEPT_RECORDS_MAX}`, 'k1', t0 + KEPT_RECORD_MS - 1)?.record).to.deep.include({ result: { i: KEPT_RECORDS_MAX } });
    for (let i = 0; i <= KEPT_RECORDS_MAX; i++) takeKept(channel, `t-many-${i}`, 'k1', t0);
  });

  it("keeps no record that lost to another standing in Redis (the reaper's)", async () => {
    const ctx = s.built.ctx;
    const names = new Names(s.prefix);
    const tenant = tenantId(API_KEY);
    const jobId = 't-fastpathlost-1';
    const requestId = encodeRequestId({ queue: 'train-agent-fastpath', jobId });
    await ctx.registry.futures.setOwner(requestId, tenant, 600);
    await new Outcomes(other, names, 3_600).failUnknown(jobId, 'optim_step', 'agent-fastpath', 'reaped');
    expectHandOver(names.outcomesChannel(), jobId, tenant);
    const stands = await new Outcomes(other, names, 3_600).finish(jobId, 'x', { state: 'done', op: 'optim_step', agent_id: 'agent-fastpath', result: { metrics: {} } }, true);
    expect(stands).to.deep.include({ state: 'failed', code: 'OUTCOME_UNKNOWN' });
    expect(await ctx.futures.retrieve(requestId, tenant, 1_000)).to.deep.include({ kind: 'failed', code: 'OUTCOME_UNKNOWN' });
  });

  it('answers from the message on Redis alone (the agent in another process)', async () => {
    const names = new Names(s.prefix);
    const jobId = 't-fastpathremote-1';
    const { answer } = await waitingFuture(jobId);
    // What outcome-finish.lua does, from a connection of another process: record, then publish.
    const record = doneRecord({ remote: 1 });
    await other.set(names.outcome(jobId), record, 'EX', 600);
    await other.publish(names.outcomesChannel(), signalMessage(jobId, record));
    expect(await within(answer, 'not answered from the Redis message')).to.deep.include({ kind: 'done', result: { metrics: { remote: 1 } } });
  });

  it("hands a training op's outcome to a waiter in this process before recording it, and the record's script applies the waiter's read-once expiry", async () => {
    const ctx = s.built.ctx;
    const names = new Names(s.prefix);
    const jobId = 't-fastpathearly-1';
    const requestId = encodeRequestId({ queue: 'train-agent-fastpath', jobId });
    const { answer } = await waitingFuture(jobId);
    const redis = ctx.redis as Redis & { sendCommand: (c: { name: string; args: unknown[] }) => unknown };
    const seen: string[] = [];
    const orig = redis.sendCommand;
    redis.sendCommand = function (this: Redis, c: { name: string; args: unknown[] }) {
      seen.push(c.name);
      return orig.call(this, c as never);
    } as typeof redis.sendCommand;
    let first: string;
    // The record is sent only once the answer is out (the answer is written in the promise jobs the hand-over queued).
    let answered = false;
    let sentAfterAnswer: boolean | undefined;
    void answer.then(() => (answered = true));
    const agentSide = other as Redis & { sendCommand: (c: { name: string; args: unknown[] }) => unknown };
    const sendOther = agentSide.sendCommand;
    agentSide.sendCommand = function (this: Redis, c: { name: string; args: unknown[] }) {
      if (c.name === 'evalsha' && sentAfterAnswer === undefined) sentAfterAnswer = answered;
      return sendOther.call(this, c as never);
    } as typeof agentSide.sendCommand;
    try {
      // The agent's finish (early: it has the result in hand), on a connection of its own.
      const recorded = new Outcomes(other, names, 3_600).finish(jobId, '', { state: 'done', op: 'optim_step', agent_id: 'agent-fastpath', result: { metrics: { early: 1 } } }, true);
      first = await Promise.race([answer.then(() => 'answered'), recorded.then(() => 'recorded')]);
      expect(await within(answer, 'not answered from the hand-over')).to.deep.include({ kind: 'done', result: { metrics: { early: 1 } } });
      expect((await recorded).state).to.equal('done');
      await new Promise((r) => setTimeout(r, 50));
    } finally {
      redis.sendCommand = orig;
      agentSide.sendCommand = sendOther;
    }
    expect(first).to.equal('answered');
    expect(sentAfterAnswer).to.equal(true);
    // Recorded whole, and read once: the record, its job and its owner leave within the read TTL,
    // set by the record's own script (the API sent no expiry of its own).
    expect(JSON.parse((await other.get(names.outcome(jobId)))!)).to.deep.include({ state: 'done', result: { metrics: { early: 1 } } });
    for (const key of [names.outcome(jobId), ctx.queues.jobKey('train-agent-fastpath', jobId), names.futureOwner(requestId)])
      expect(await other.pttl(key), key).to.be.within(1, 300_000);
    expect(seen.filter((c) => c === 'multi' || c === 'pexpire')).to.deep.equal([]);
  });
});
