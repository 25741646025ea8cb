import { rmSync } from 'node:fs';
import { Queue, Worker, type Job } from 'bullmq';
import { expect } from 'chai';
import { Completions, EXPECTED_SAMPLES_MAX, expectedSampleTenant, expectSampleEnd, KEPT_RECORD_MS, KEPT_SAMPLE_BYTES_MAX, keepSampleEnd, keptSampleStats, sampleEndSignal, signalLocally, takeKeptSample } from '../queues/runtime/completions.js';
import { decodeRequestId } from '../queues/contract/futures.js';
import { Names, jobIds } from '../queues/contract/names.js';
import type { AgentRecord, ServedModel } from '../queues/registry/agents.js';
import {
  addSampleEnd,
  addSessionFuture,
  CLONE_SEQ_SPAN,
  readSessionFutures,
  reconcileSessionFutures,
  SESSION_FUTURES_MAX,
  SESSION_FAILURE_MESSAGE_MAX,
  SESSION_FUTURES_PER_POLL,
  SESSION_PENDING_MAX,
  SESSION_RECONCILE_BATCH,
  SESSION_RECONCILED_MAX,
  sessionKeys,
  sessionSignalKey,
  trackPendingSample,
  type SessionEnd,
} from '../queues/runtime/session-futures.js';
import { TINY_MODEL_ALIAS } from '../scripts/stack.js';
import { API_KEY, API_KEY_B, awaitFuture, call, deletePrefix, REDIS_URL, startStack, type HttpReply, type TestStack } from './helpers/stack.js';
import { tenantId } from '../api/auth.js';
import { Redis } from 'ioredis';

/**
 * retrieve_futures, the SDK's session poller (SDK 0.27+ with `sample_use_retrieve_futures`): per
 * client of a sampling session, the samples that ended since the client's cursor, long-polled;
 * entries at or before the cursor it sends back leave. Real server, agent, engine (tiny model) and Redis.
 */
/**
 * Samples that end without their agent's entry. A ghost sampler takes the place of the agent that
 * dies: an agent record of an engine kind of its own, of the highest sampling priority, serving
 * `model`, so the API queues that model's samples on its queue; the test takes each job there with
 * a BullMQ worker of its own and ends it through BullMQ, as a dying agent's worker would leave it
 * (or BullMQ's stalled-job check, or a removal), and no end transaction of an agent ever runs.
 */
type Ghost = { queue: Queue; take: () => Promise<Job>; token: string };
/** What a ghost sampler's jobs end with. */
const RESULT = { sequences: [{ tokens: [7, 8, 9], logprobs: [-0.5, -0.25, -1], stop_reason: 'length' as const }], prompt_logprobs: null, topk_prompt_logprobs: null };
async function withGhostSampler(s: TestStack, model: ServedModel, run: (g: Ghost) => Promise<void>): Promise<void> {
  const { redis, names } = s.built.ctx;
  const agentId = `ghost-${s.prefix}`;
  const record: AgentRecord = {
    agent_id: agentId, train_queue: `train-${agentId}`, models: [{ ...model, trainable: false }], engine: 'ghost', device: 'cpu',
    started_at: new Date().toISOString(), capabilities: { trains: false, samples: true, sample_priority: 1_000, drains: false },
  };
  const name = names.sampleQueue(model.name, 'ghost');
  const connection = new Redis(REDIS_URL, { maxRetriesPerRequest: null });
  const queue = new Queue(name, { connection, prefix: names.bull });
  const worker = new Worker(name, undefined, { connection, prefix: names.bull });
  const token = `ghost-token-${s.prefix}`;
  await redis.multi().hset(names.agents(), agentId, JSON.stringify(record)).set(names.agentAlive(agentId), `ghost ${Date.now()}`, 'EX', 600).exec();
  try {
    await run({
      queue,
      token,
      take: async () => {
        for (;;) {
          const job = await worker.getNextJob(token, { block: false });
          if (job) return job;
          await new Promise((r) => setTimeout(r, 20));
        }
      },
    });
  } finally {
    await redis.hdel(names.agents(), agentId);
    await redis.del(names.agentAlive(agentId));
    await worker.close();
    await queue.close();
    connection.disconnect();
  }
}

describe('retrieve_futures (the session poller)', function () {
  this.timeout(300_000);
  let s: TestStack;
  let sessionId: string;
  let samplingSession: string;
  let samplingSeq = 0;
  const prompt = { chunks: [{ type: 'encoded_text', tokens: [5, 17, 42] }] };
  const sp = { max_tokens: 3, seed: 1, temperature: 1, top_k: -1, top_p: 1, stop: [] };

  // A long-poll window far beyond any sample here: a poll that answers with an entry was woken by it.
  before(async () => {
    s = await startStack({ longPollMs: 120_000, env: { TB_SAMPLE_RETRIEVE_FUTURES: 'true' } });
    sessionId = (await call(s.baseUrl, 'POST', '/create_session', { tags: [], sdk_version: '0.38.0' })).json.session_id;
    samplingSession = await newSamplingSession();
  });
  after(async () => s?.stop());

  const ok = (r: HttpReply) => {
    expect(r.status, JSON.stringify(r.json)).to.equal(200);
    return r;
  };
  async function newSamplingSession(body: Record<string, unknown> = { base_model: TINY_MODEL_ALIAS }): Promise<string> {
    return ok(await call(s.baseUrl, 'POST', '/create_sampling_session', { session_id: sessionId, sampling_session_seq_id: samplingSeq++, ...body })).json.sampling_session_id;
  }
  async function sample(session: string, seqId: number): Promise<string> {
    return ok(await call(s.baseUrl, 'POST', '/asample', { sampling_session_id: session, seq_id: seqId, num_samples: 1, prompt, sampling_params: sp })).json.request_id;
  }
  function poll(session: string, prevCursor: number, opts: { clone?: number; timeout?: number | null; key?: string } = {}): Promise<HttpReply> {
    const body = {
      target: { type: 'sampling_session', sampling_session_id: session, cloned_sampler_id: opts.clone ?? 0 },
      prev_cursor: prevCursor,
      ...(opts.timeout === null ? {} : { timeout: opts.timeout ?? 0 }),
      retrieved_request_ids: [],
    };
    return call(s.baseUrl, 'POST', '/retrieve_futures', body, opts.key ? { key: opts.key } : {});
  }
  const logLength = (session: string, clone = 0) => s.built.ctx.redis.xlen(s.built.ctx.names.sessionFutures(session, clone));

  it('reports each ended sample of a client once, with a cursor whose echo acknowledges them', async () => {
    const ids = [await sample(samplingSession, 0), await sample(samplingSession, 1)];
    for (const id of ids) expect((await awaitFuture(s.baseUrl, id)).json.type).to.equal('sample');
    // Each entry is written with its sample's end (an answer above may come a moment before it).
    let first: { completions: { request_id: string }[]; cursor: number };
    do first = ok(await poll(samplingSession, 0, { timeout: null })).json;
    while (first.completions.length < ids.length);
    expect(first.completions.map((c: { request_id: string }) => c.request_id).sort()).to.deep.equal([...ids].sort());
    for (const c of first.completions) expect(c).to.deep.equal({ state: 'finished', request_id: c.request_id });
    expect(first.cursor).to.be.a('number').and.be.greaterThan(0);
    // An answer the client lost: the same cursor gets the same entries again (nothing was acknowledged).
    expect(ok(await poll(samplingSession, 0)).json).to.deep.equal(first);
    // Passing the cursor back acknowledges them: they leave, and the cursor stays.
    expect(ok(await poll(samplingSession, first.cursor)).json).to.deep.equal({ completions: [], cursor: first.cursor });
    expect(await logLength(samplingSession)).to.equal(0);
    expect(ok(await poll(samplingSession, 0)).json.completions).to.deep.equal([]);
  });

  it('holds a poll open until a sample of its client ends, and keeps clones apart', async () => {
    const start = ok(await poll(samplingSession, 0)).json.cursor as number;
    // Clone 1 of the same session (seq_ids from 1e9): its own log and cursor.
    const clone1 = poll(samplingSession, 0, { clone: 1, timeout: null });
    const waiting = poll(samplingSession, start, { timeout: null });
    const id = await sample(samplingSession, 2);
    const got = ok(await waiting).json;
    expect(got.completions).to.deep.equal([{ state: 'finished', request_id: id }]);
    expect(got.cursor).to.be.greaterThan(start);
    const idClone = await sample(samplingSession, CLONE_SEQ_SPAN);
    expect(ok(await clone1).json.completions).to.deep.equal([{ state: 'finished', request_id: idClone }]);
    // Clone 0 saw nothing of clone 1's sample.
    expect(ok(await poll(samplingSession, got.cursor)).json).to.deep.equal({ completions: [], cursor: got.cursor });
    // The result itself is fetched with retrieve_future, as before.
    expect((await awaitFuture(s.baseUrl, id)).json.sequences).to.have.length(1);
  });

  it('reports failed samples with the Tinker error shape, refused before queueing or failed by the engine', async () => {
    const cm = ok(await call(s.baseUrl, 'POST', '/create_model', { session_id: sessionId, model_seq_id: 0, base_model: TINY_MODEL_ALIAS, lora_config: { rank: 2 } }));
    const modelId = (await awaitFuture(s.baseUrl, cm.json.request_id)).json.model_id as string;
    const save = async (seqId: number, name: string) => {
      const r = ok(await call(s.baseUrl, 'POST', '/save_weights_for_sampler', { model_id: modelId, seq_id: seqId, path: name }));
      return (await awaitFuture(s.baseUrl, r.json.request_id)).json.path as string;
    };
    // Sampler weights deleted through the API: the API refuses the sample (STALE_SAMPLER).
    const gone = await save(1, 'gone');
    const stale = await newSamplingSession({ model_path: gone });
    expect((await call(s.baseUrl, 'DELETE', `/training_runs/${modelId}/checkpoints/sampler_weights/gone`)).status).to.equal(200);
    const refused = await sample(stale, 0);
    const expected = (await awaitFuture(s.baseUrl, refused)).json;
    expect(expected).to.include({ category: 'user', code: 'STALE_SAMPLER' });
    expect(ok(await poll(stale, 0, { timeout: null })).json.completions).to.deep.equal([{ state: 'failed', request_id: refused, ...expected }]);

    // Sampler weights whose files vanished under a live record: the engine fails the sample.
    const broken = await save(2, 'broken');
    const brokenSession = await newSamplingSession({ model_path: broken });
    const ckpt = await s.built.ctx.registry.checkpoints.get(broken);
    rmSync(ckpt!.dir, { recursive: true, force: true });
    const waiting = poll(brokenSession, 0, { timeout: null });
    const failed = await sample(brokenSession, 0);
    const entries = ok(await waiting).json.completions;
    const answer = (await awaitFuture(s.baseUrl, failed)).json;
    expect(answer.error, JSON.stringify(answer)).to.be.a('string');
    const error = answer.error.slice(0, SESSION_FAILURE_MESSAGE_MAX);
    expect(entries).to.deep.equal([{ state: 'failed', request_id: failed, error, category: answer.category, code: answer.code }]);
  });

  it("answers another tenant's poll as for a session that does not exist, and leaves the owner's log as it is", async () => {
    const id = await sample(samplingSession, 3);
    await awaitFuture(s.baseUrl, id);
    const before = await logLength(samplingSession);
    expect(before).to.be.greaterThan(0);
    const theirs = await poll(samplingSession, Number.MAX_SAFE_INTEGER, { key: API_KEY_B, timeout: null });
    const none = await poll(`${sessionId}:sample:999`, 0, { key: API_KEY_B });
    expect(theirs.status).to.equal(404);
    expect(none.status).to.equal(404);
    expect(theirs.json).to.deep.equal({ ...none.json, error: none.json.error.replace(`${sessionId}:sample:999`, samplingSession) });
    expect(theirs.json).to.include({ category: 'user', code: 'NOT_FOUND' });
    expect(await logLength(samplingSession)).to.equal(before);
    expect(ok(await poll(samplingSession, 0)).json.completions.map((c: { request_id: string }) => c.request_id)).to.include(id);
  });

  it('answers 400 for a malformed poll', async () => {
    for (const body of [{}, { target: { sampling_session_id: samplingSession }, prev_cursor: -1 }, { target: { type: 'model', sampling_session_id: samplingSession } }]) {
      const r = await call(s.baseUrl, 'POST', '/retrieve_futures', body);
      expect(r.status, JSON.stringify(r.json)).to.equal(400);
      expect(r.json.error).to.match(/invalid retrieve_futures request/);
    }
  });

  it("answers the client's fetch of a sample the poller reported from the end this API was signalled, once, to its tenant only", async () => {
    const session = await newSamplingSession();
    const [mine, other] = [await sample(session, 0), await sample(session, 1)];
    const seen = new Set<string>();
    while (seen.size < 2) for (const c of ok(await poll(session, 0, { timeout: null })).json.completions) seen.add(c.request_id);
    const { redis, names, queues } = s.built.ctx;
    const keysOf = (id: string) => {
      const ref = decodeRequestId(id)!;
      return { job: queues.jobKey(ref.queue, ref.jobId), owner: names.futureOwner(id) };
    };
    // What Redis holds of the first sample; then nothing: an answer now can only come from this process.
    const stored = JSON.parse((await redis.hget(keysOf(mine).job, 'returnvalue'))!);
    expect(stored.sequences).to.have.length(1);
    await redis.del(keysOf(mine).job, keysOf(mine).owner);
    // Another tenant's fetch is refused as for an unknown future, and leaves the record to its owner.
    const stranger = await call(s.baseUrl, 'POST', '/retrieve_future', { request_id: mine }, { key: API_KEY_B });
    expect(stranger.status).to.equal(404);
    const answer = ok(await call(s.baseUrl, 'POST', '/retrieve_future', { request_id: mine })).json;
    expect(answer).to.deep.include({ type: 'sample', sequences: stored.sequences });
    // Taken by that read: a second one reads Redis, which has nothing left.
    expect((await call(s.baseUrl, 'POST', '/retrieve_future', { request_id: mine })).status).to.equal(404);
    // A fetch answered from here still lets the sample's job and owner record leave soon, as a read of Redis does.
    const before = await redis.pttl(keysOf(other).job);
    expect(before, 'a finished sample not read yet').to.equal(-1);
    expect(ok(await call(s.baseUrl, 'POST', '/retrieve_future', { request_id: other })).json.sequences).to.have.length(1);
    let ttl = -1;
    for (let i = 0; i < 100 && ttl === -1; i++) {
      await new Promise((r) => setTimeout(r, 10));
      ttl = await redis.pttl(keysOf(other).job);
    }
    expect(ttl).to.be.within(1, s.built.ctx.config.retentionS * 1000);
    expect(await redis.pttl(keysOf(other).owner)).to.be.within(1, 300_000);
  });

  it('keeps sample ends for the first fetch only within their bounds: expected samples, bytes, time', () => {
    // Synchronous: the stack in this process does nothing meanwhile.
    const channel = new Names(`${s.prefix}-keptsamples`).outcomesChannel();
    const t0 = Date.now();
    const record = (i: number, pad = 0) => JSON.stringify({ state: 'done', op: 'sample', agent_id: 'a', token: 't', at: 'now', result: { i, pad: 'x'.repeat(pad) } });
    const keep = (jobId: string, r: string, now = t0) => keepSampleEnd(channel, jobId, 'k1', r, now);
    // Past its time: not answered.
    keep('s-late', record(1));
    expect(takeKeptSample(channel, 's-late', 'k1', t0 + KEPT_RECORD_MS)).to.equal(undefined);
    // Bytes: the oldest record goes once the total passes the bound.
    const big = Math.floor(KEPT_SAMPLE_BYTES_MAX / 2.5);
    for (const i of [1, 2, 3]) keep(`s-big-${i}`, record(i, big));
    expect(keptSampleStats().bytes).to.be.at.most(KEPT_SAMPLE_BYTES_MAX);
    expect(takeKeptSample(channel, 's-big-1', 'k1', t0), 'the oldest past the bound').to.equal(undefined);
    expect(takeKeptSample(channel, 's-big-2', 'k2', t0), 'another tenant').to.equal(undefined);
    expect(JSON.parse(takeKeptSample(channel, 's-big-2', 'k1', t0)!).result.i).to.equal(2);
    expect(takeKeptSample(channel, 's-big-2', 'k1', t0), 'taken once').to.equal(undefined);
    expect(JSON.parse(takeKeptSample(channel, 's-big-3', 'k1', t0)!).result.i).to.equal(3);
    // Expectations: the newest EXPECTED_SAMPLES_MAX; each kept record past its time leaves as the next comes.
    for (let i = 0; i <= EXPECTED_SAMPLES_MAX; i++) expectSampleEnd(channel, `s-many-${i}`, 'k1', t0);
    expect(keptSampleStats().expected).to.equal(EXPECTED_SAMPLES_MAX);
    for (let i = 0; i < 100; i++) keep(`s-old-${i}`, record(i));
    expect(keptSampleStats().kept).to.be.at.least(100);
    keep('s-new', record(0), t0 + KEPT_RECORD_MS);
    expect(keptSampleStats().kept).to.equal(1);
    expect(takeKeptSample(channel, 's-new', 'k1', t0 + KEPT_RECORD_MS)).to.be.a('string');
    expect(keptSampleStats()).to.deep.include({ kept: 0, bytes: 0 });
  });

  it("keeps no sample end its client's retrieve_future waited for, and none of a sample submitted elsewhere", async () => {
    const { names } = s.built.ctx;
    const channel = names.outcomesChannel();
    const c = new Completions(() => new Redis(REDIS_URL), names);
    try {
      const end = (jobId: string) => sampleEndSignal(names, jobId, 'agent-x', { state: 'done', result: { sequences: [] } })[1];
      // Submitted elsewhere (no expectation here): not kept.
      c.deliver(end('s-elsewhere-1'));
      expect(takeKeptSample(channel, 's-elsewhere-1', 'k1')).to.equal(undefined);
      // Its tenant's retrieve_future waits here: woken with the record, nothing kept.
      expectSampleEnd(channel, 's-waited-1', 'k1');
      const w = await c.watch({ queue: 'sample-x', jobId: 's-waited-1' }, 'k1');
      c.deliver(end('s-waited-1'));
      expect((await w.woken).record).to.be.a('string');
      w.cancel();
      expect(takeKeptSample(channel, 's-waited-1', 'k1')).to.equal(undefined);
      // Another tenant's waits: the owner's record is kept.
      expectSampleEnd(channel, 's-stranger-1', 'k1');
      const x = await c.watch({ queue: 'sample-x', jobId: 's-stranger-1' }, 'k2');
      c.deliver(end('s-stranger-1'));
      x.cancel();
      expect(JSON.parse(takeKeptSample(channel, 's-stranger-1', 'k1')!)).to.deep.include({ state: 'done', op: 'sample' });
    } finally {
      await c.close();
    }
  });

  it('holds at most SESSION_FUTURES_MAX entries per client, the oldest leaving; their results stay readable with retrieve_future', async () => {
    const session = await newSamplingSession();
    const real = [await sample(session, 0), await sample(session, 1)];
    // Both ended and logged (the poll does not acknowledge anything: cursor 0).
    const seen = new Set<string>();
    while (seen.size < 2) for (const c of ok(await poll(session, 0, { timeout: null })).json.completions) seen.add(c.request_id);
    // A client that never acknowledges: entries beyond the bound push the oldest out.
    const { redis, names, config } = s.built.ctx;
    const key = names.sessionFutures(session, 0);
    const m = redis.pipeline();
    for (let i = 0; i < SESSION_FUTURES_MAX; i++) addSessionFuture(m, key, `sample-x/s-flood-${i}`, { state: 'done' }, config.retentionS);
    await m.exec();
    expect(await redis.xlen(key)).to.equal(SESSION_FUTURES_MAX);
    expect(await redis.pttl(key)).to.be.greaterThan(0);
    // The log, walked with the cursor, a bounded page per answer: only the newest SESSION_FUTURES_MAX.
    const walked: string[] = [];
    let cursor = 0;
    for (;;) {
      const page = ok(await poll(session, cursor)).json;
      if (page.completions.length === 0) break;
      expect(page.completions.length).to.be.at.most(SESSION_FUTURES_PER_POLL);
      walked.push(...page.completions.map((c: { request_id: string }) => c.request_id));
      cursor = page.cursor;
    }
    expect(walked).to.have.length(SESSION_FUTURES_MAX);
    expect(walked[0]).to.equal('sample-x/s-flood-0');
    for (const id of real) expect(walked).to.not.include(id);
    expect(await redis.xlen(key)).to.equal(0);
    for (const id of real) expect((await awaitFuture(s.baseUrl, id)).json.sequences).to.have.length(1);
  });

  /**
   * Samples that end without their agent's entry. A ghost sampler takes the place of the agent that
   * dies: an agent record of an engine kind of its own, of the highest sampling priority, so the API
   * queues the tiny model's samples on its queue; the test takes each job there with a BullMQ worker
   * of its own and ends it through BullMQ, as a dying agent's worker would leave it (or BullMQ's
   * stalled-job check, or a removal), and no end transaction of an agent ever runs.
   */
  const tinyModel = async () => (await s.built.ctx.registry.agents.live()).flatMap((a) => a.models).find((m) => m.aliases.includes(TINY_MODEL_ALIAS))!;
  const ctx = () => s.built.ctx;

  it("reports a sample whose job BullMQ completed without its agent's entry (the agent died before its end transaction) to the poll waiting, once", async () => {
    const session = await newSamplingSession();
    const keys = sessionKeys(ctx().names, session, 0);
    await withGhostSampler(s, await tinyModel(), async (ghost) => {
      const waiting = poll(session, 0, { timeout: null });
      const id = await sample(session, 0);
      expect(await ctx().redis.sismember(keys.pending, id)).to.equal(1);
      const job = await ghost.take();
      expect(job.id).to.equal(decodeRequestId(id)!.jobId);
      await job.moveToCompleted(RESULT, ghost.token, false);
      // Nobody signals it: the waiting poll finds it at its next reconcile.
      const got = ok(await waiting).json;
      expect(got.completions).to.deep.equal([{ state: 'finished', request_id: id }]);
      expect(await ctx().redis.sismember(keys.pending, id)).to.equal(0);
      expect((await awaitFuture(s.baseUrl, id)).json.sequences.map((q: { tokens: number[] }) => q.tokens)).to.deep.equal([[7, 8, 9]]);
      // Its agent's end transaction after all, late: its entry is not reported a second time.
      const m = ctx().redis.multi();
      addSampleEnd(m, ctx().names, { id: job.id!, queue: job.queueName, sampling_session_id: session, seq_id: 0 }, { state: 'done' }, ctx().config.retentionS);
      await m.exec();
      expect(await ctx().redis.xlen(keys.log)).to.equal(2);
      const next = ok(await poll(session, got.cursor)).json;
      expect(next.completions).to.deep.equal([]);
      expect(ok(await poll(session, next.cursor)).json).to.deep.equal({ completions: [], cursor: next.cursor });
      expect(await ctx().redis.xlen(keys.log)).to.equal(0);
    });
  });

  it('reports a sample failed through BullMQ alone (a stall, a crash) with the error retrieve_future answers', async () => {
    const session = await newSamplingSession();
    await withGhostSampler(s, await tinyModel(), async (ghost) => {
      const id = await sample(session, 0);
      const job = await ghost.take();
      await job.moveToFailed(new Error('job stalled more than allowable limit'), ghost.token, false);
      const answer = (await awaitFuture(s.baseUrl, id)).json;
      expect(answer).to.include({ category: 'server', code: 'INTERNAL', error: 'job stalled more than allowable limit' });
      expect(ok(await poll(session, 0, { timeout: null })).json.completions).to.deep.equal([{ state: 'failed', request_id: id, ...answer }]);
    });
  });

  it('answers a waiting retrieve_future of a sample submitted here that ended with no signal (its agent died) once it reads the state, well within its window', async () => {
    const session = await newSamplingSession();
    await withGhostSampler(s, await tinyModel(), async (ghost) => {
      const id = await sample(session, 0);
      const job = await ghost.take();
      // A window longer than this test may run: the answer must come from the bounded read, not the window's end.
      const waiting = s.built.ctx.futures.retrieve(id, tenantId(API_KEY), 3_600_000);
      await job.moveToCompleted(RESULT, ghost.token, false);
      expect(await waiting).to.deep.include({ kind: 'done', result: RESULT });
    });
  });

  it('reports a sample whose job was removed as the unknown future retrieve_future answers', async () => {
    const session = await newSamplingSession();
    await withGhostSampler(s, await tinyModel(), async (ghost) => {
      const id = await sample(session, 0);
      expect(await ghost.queue.remove(decodeRequestId(id)!.jobId)).to.equal(1);
      const got = ok(await poll(session, 0, { timeout: null })).json;
      const answer = await call(s.baseUrl, 'POST', '/retrieve_future', { request_id: id });
      expect(answer.status).to.equal(404);
      expect(answer.json).to.include({ category: 'user', code: 'NOT_FOUND' });
      expect(got.completions).to.deep.equal([{ state: 'failed', request_id: id, ...answer.json }]);
    });
  });

  it('reports each sample of the normal path once while reconciles race its agents’ end transactions', async () => {
    const session = await newSamplingSession();
    const { redis, names } = ctx();
    const keys = sessionKeys(names, session, 0);
    // The agent's end signals, sent in its end transactions after their entries: once all came, every agent entry is in the log.
    const sub = new Redis(REDIS_URL);
    const agentEnded = new Set<string>();
    sub.on('message', (_channel: string, message: string) => {
      const space = message.indexOf(' ');
      if (space > 0 && message.includes(`"agent_id":"${s.agent!.config.agentId}"`)) agentEnded.add(message.slice(0, space));
    });
    await sub.subscribe(names.outcomesChannel());
    try {
      const n = 12;
      let ids: string[] | null = null;
      const submitted = Promise.all(Array.from({ length: n }, (_, i) => sample(session, i))).then((v) => (ids = v));
      const seen: string[] = [];
      let cursor = 0;
      // Every poll may reconcile (its turn freed): one that reads a sample's end between BullMQ's record
      // and its agent's transaction races that transaction; whichever comes first writes the entry.
      const ended = () => ids !== null && ids.every((id) => agentEnded.has(decodeRequestId(id)!.jobId));
      while (!ended() || new Set(seen).size < n) {
        await redis.del(keys.turn);
        const page = ok(await poll(session, cursor)).json;
        seen.push(...page.completions.map((c: { request_id: string }) => c.request_id));
        cursor = page.cursor;
      }
      await submitted;
      // Every agent entry is in the log now: those of samples a reconcile reported are skipped.
      await redis.del(keys.turn);
      const rest = ok(await poll(session, cursor)).json;
      seen.push(...rest.completions.map((c: { request_id: string }) => c.request_id));
      expect([...seen].sort()).to.deep.equal([...ids!].sort());
      expect(await redis.scard(keys.pending)).to.equal(0);
    } finally {
      sub.disconnect();
    }
  });

  it('bounds the pending and reconciled sets, and what one reconcile reads', async () => {
    const session = await newSamplingSession();
    const { redis, names } = ctx();
    const keys = sessionKeys(names, session, 0);
    // A client at the bound (ids of samples that never existed), with as many reconciled already.
    const fill = redis.pipeline();
    for (let i = 0; i < SESSION_PENDING_MAX; i += 1000) {
      fill.sadd(keys.pending, ...Array.from({ length: 1000 }, (_, k) => `sample-x/s-fake-${i + k}`));
      fill.sadd(keys.reconciled, ...Array.from({ length: 1000 }, (_, k) => `sample-x/s-old-${i + k}`));
    }
    await fill.exec();
    expect(await redis.scard(keys.reconciled)).to.equal(SESSION_RECONCILED_MAX);
    // A sample queued beyond the bound is not tracked, and its agent reports it.
    const id = await sample(session, 0);
    expect(await redis.sismember(keys.pending, id)).to.equal(0);
    expect(await redis.scard(keys.pending)).to.equal(SESSION_PENDING_MAX);
    let cursor = 0;
    for (let found = false; !found; ) {
      const page = ok(await poll(session, cursor, { timeout: null })).json;
      found = page.completions.some((c: { request_id: string }) => c.request_id === id);
      cursor = page.cursor;
    }
    // One reconcile reads SESSION_RECONCILE_BATCH of them; every one is gone (no owner, no job): reported as unknown futures.
    await redis.del(keys.turn);
    const before = await redis.scard(keys.pending);
    const page = ok(await poll(session, cursor)).json;
    expect(page.completions).to.have.length(SESSION_RECONCILE_BATCH);
    expect(await redis.scard(keys.pending)).to.equal(before - SESSION_RECONCILE_BATCH);
    const one = page.completions[0];
    expect(one.request_id).to.match(/^sample-x\/s-fake-\d+$/);
    expect(one).to.deep.equal({ state: 'failed', request_id: one.request_id, error: `unknown or expired future '${one.request_id}'`, category: 'user', code: 'NOT_FOUND' });
    expect(await redis.scard(keys.reconciled)).to.equal(SESSION_RECONCILED_MAX);
    // The next poll within the turn does not reconcile.
    const quiet = ok(await poll(session, page.cursor)).json;
    expect(quiet).to.deep.equal({ completions: [], cursor: page.cursor });
    expect(await redis.scard(keys.pending)).to.equal(before - SESSION_RECONCILE_BATCH);
  });
});

describe('expected sample ends and the subscription (real Redis)', function () {
  this.timeout(60_000);
  it('forgets every expectation when the subscription breaks, and expects again once subscribed again', async () => {
    const names = new Names(`test-live-${Date.now()}`);
    const channel = names.outcomesChannel();
    let conn: Redis | undefined;
    const publisher = new Redis(REDIS_URL);
    const c = new Completions(() => (conn = new Redis(REDIS_URL)), names);
    const until = async (what: () => boolean) => {
      for (let i = 0; i < 500 && !what(); i++) await new Promise((r) => setTimeout(r, 10));
      expect(what()).to.equal(true);
    };
    try {
      expect(c.live, 'not subscribed yet').to.equal(false);
      await c.listen();
      expect(c.live).to.equal(true);
      expectSampleEnd(channel, 's-live-1', 'k1');
      expect(expectedSampleTenant(channel, 's-live-1')).to.equal('k1');
      // The network drops the subscriber's connection: signals sent until it is back are lost.
      conn!.stream.destroy();
      await until(() => !c.live);
      expect(expectedSampleTenant(channel, 's-live-1'), 'its end may never be heard').to.equal(undefined);
      // ioredis reconnects; the subscription is made again, and a signal reaches a waiter.
      await until(() => c.live);
      const w = await c.watch({ queue: 'sample-x', jobId: 's-live-2' }, 'k1');
      await publisher.publish(channel, sampleEndSignal(names, 's-live-2', 'agent-x', { state: 'done', result: { sequences: [] } })[1]);
      expect((await w.woken).record).to.be.a('string');
      w.cancel();
    } finally {
      await c.close();
      conn?.disconnect();
      publisher.disconnect();
    }
  });
});

describe('Completions.watchSession (real Redis)', function () {
  this.timeout(60_000);
  it("wakes a poll on the message of one of its client's samples from Redis, not of another client's or session's, nor on a hand-over in this process", async () => {
    const names = new Names(`test-watch-${Date.now()}`);
    const conns: Redis[] = [];
    const completions = new Completions(() => {
      const c = new Redis(REDIS_URL);
      conns.push(c);
      return c;
    }, names);
    const pub = new Redis(REDIS_URL);
    const channel = names.outcomesChannel();
    const until = async (what: () => boolean) => {
      while (!what()) await new Promise((r) => setTimeout(r, 5));
    };
    try {
      const counted = async (session: string, clone: number) => {
        const w = await completions.watchSession(sessionSignalKey(session, clone));
        const c = { woken: 0, arm: () => void w.next().then(() => c.woken++), cancel: w.cancel };
        return c;
      };
      const mine = await counted('sess:sample:0', 1);
      const probe = await counted('sess:sample:9', 0);
      mine.arm();
      probe.arm();
      // Handed over in this process: its log entry is not written yet; the message from Redis wakes.
      signalLocally(channel, jobIds.sample('sess:sample:0', CLONE_SEQ_SPAN + 1));
      await new Promise((r) => setImmediate(r));
      expect(mine.woken).to.equal(0);
      await pub.publish(channel, jobIds.sample('sess:sample:0', 5)); // clone 0
      await pub.publish(channel, jobIds.sample('sess:sample:1', CLONE_SEQ_SPAN + 5)); // another session
      await pub.publish(channel, 's-0b0c7f3e-5d1a-4c8e-9a43-123456789012'); // a sample without a session
      await pub.publish(channel, jobIds.sample('sess:sample:9', 3)); // the probe's: every message before it was delivered
      await until(() => probe.woken === 1);
      expect(mine.woken).to.equal(0);
      await pub.publish(channel, `${jobIds.sample('sess:sample:0', CLONE_SEQ_SPAN + 7)} {"state":"done"}`);
      await until(() => mine.woken === 1);
      // Armed again, woken again; cancelled, not any more.
      mine.arm();
      await pub.publish(channel, jobIds.sample('sess:sample:0', CLONE_SEQ_SPAN + 8));
      await until(() => mine.woken === 2);
      mine.arm();
      mine.cancel();
      probe.arm();
      await pub.publish(channel, jobIds.sample('sess:sample:0', CLONE_SEQ_SPAN + 9));
      await pub.publish(channel, jobIds.sample('sess:sample:9', 4));
      await until(() => probe.woken === 2);
      expect(mine.woken).to.equal(2);
    } finally {
      await completions.close();
      for (const c of [...conns, pub]) c.disconnect();
    }
  });
});

describe('reconcileSessionFutures against the agent’s end transaction (real Redis)', function () {
  this.timeout(60_000);
  let redis: Redis;
  let names: Names;
  const session = 'sess:sample:0';
  const job = (seq: number) => ({ id: jobIds.sample(session, seq), queue: 'sample-q', sampling_session_id: session, seq_id: seq });
  const requestId = (seq: number) => `sample-q/${jobIds.sample(session, seq)}`;
  const agentEnd = async (seq: number) => {
    const m = redis.multi();
    addSampleEnd(m, names, job(seq), { state: 'done' }, 60);
    await m.exec();
  };
  beforeEach(async () => {
    redis = new Redis(REDIS_URL);
    names = new Names(`test-reconcile-${Date.now()}`);
  });
  afterEach(async () => {
    redis.disconnect();
    await deletePrefix(names.prefix);
  });

  it('keeps the agent’s entry when the agent’s transaction comes between the read and the claim', async () => {
    const keys = sessionKeys(names, session, 0);
    expect(await trackPendingSample(redis, names, job(1), 60)).to.equal(true);
    // The sample's state is read as ended; its agent's transaction lands before the reconcile's.
    const stateOf = async (): Promise<SessionEnd> => {
      await agentEnd(1);
      return { state: 'done' };
    };
    expect(await reconcileSessionFutures(redis, names, keys, stateOf, 60)).to.deep.equal({ added: 0, next: '0' });
    const read = await readSessionFutures(redis, keys, 0, 60);
    expect(read.completions).to.deep.equal([{ state: 'finished', request_id: requestId(1) }]);
    expect(await redis.xlen(keys.log)).to.equal(1);
    expect(await redis.scard(keys.pending)).to.equal(0);
    expect(await redis.scard(keys.reconciled)).to.equal(0);
  });

  it('writes one entry when two reconciles (two API processes) take the same samples at once', async () => {
    const keys = sessionKeys(names, session, 0);
    for (let seq = 0; seq < 5; seq++) await trackPendingSample(redis, names, job(seq), 60);
    const stateOf = async (id: string): Promise<SessionEnd | null> => (id === requestId(4) ? null : { state: 'done' });
    const [a, b] = await Promise.all([reconcileSessionFutures(redis, names, keys, stateOf, 60), reconcileSessionFutures(redis, names, keys, stateOf, 60)]);
    expect(a.added + b.added).to.equal(4);
    const read = await readSessionFutures(redis, keys, 0, 60);
    expect(read.completions.map((c) => c.request_id).sort()).to.deep.equal([0, 1, 2, 3].map(requestId).sort());
    // The one still running stays pending; the agents' entries of the others, when they come, are not reported.
    expect(await redis.smembers(keys.pending)).to.deep.equal([requestId(4)]);
    for (let seq = 0; seq < 5; seq++) await agentEnd(seq);
    const after = await readSessionFutures(redis, keys, read.cursor, 60);
    expect(after.completions).to.deep.equal([{ state: 'finished', request_id: requestId(4) }]);
    expect(await redis.scard(keys.pending)).to.equal(0);
  });

  it('tracks a sample queued again after a reconcile reported it (its agent’s entry is reported)', async () => {
    const keys = sessionKeys(names, session, 0);
    await trackPendingSample(redis, names, job(0), 60);
    expect((await reconcileSessionFutures(redis, names, keys, async () => ({ state: 'done' }), 60)).added).to.equal(1);
    const first = await readSessionFutures(redis, keys, 0, 60);
    expect(first.completions).to.have.length(1);
    await trackPendingSample(redis, names, job(0), 60);
    expect(await redis.sismember(keys.reconciled, requestId(0))).to.equal(0);
    await agentEnd(0);
    expect((await readSessionFutures(redis, keys, first.cursor, 60)).completions).to.deep.equal([{ state: 'finished', request_id: requestId(0) }]);
  });
});

describe('retrieve_futures and a full sample queue', function () {
  this.timeout(120_000);
  let s: TestStack;
  before(async () => {
    s = await startStack({ agent: false, longPollMs: 60_000, env: { TB_MAX_QUEUED_SAMPLES: '1', TB_SAMPLE_RETRIEVE_FUTURES: 'true' } });
  });
  after(async () => s?.stop());

  it('leaves a sample refused with 429 untracked, and reports it once when its resend is queued and ends', async () => {
    const model: ServedModel = { name: '/models/ghost-base', aliases: ['ghost-base'], arch: 'Ghost', vocab_size: 100, max_context_length: 256, trainable: false, lora_max_rank: 8, topk_max: 20 };
    await withGhostSampler(s, model, async (ghost) => {
      const { redis, names } = s.built.ctx;
      const sessionId = (await call(s.baseUrl, 'POST', '/create_session', { tags: [], sdk_version: '0.38.0' })).json.session_id;
      const created = await call(s.baseUrl, 'POST', '/create_sampling_session', { session_id: sessionId, sampling_session_seq_id: 0, base_model: 'ghost-base' });
      const session = created.json.sampling_session_id as string;
      const keys = sessionKeys(names, session, 0);
      const asample = (seq: number) =>
        call(s.baseUrl, 'POST', '/asample', { sampling_session_id: session, seq_id: seq, num_samples: 1, prompt: { chunks: [{ type: 'encoded_text', tokens: [1, 2] }] }, sampling_params: { max_tokens: 3 } });
      const first = await asample(0);
      expect(first.status, JSON.stringify(first.json)).to.equal(200);
      // The queue holds one: the next is refused, and is not pending (no entry could ever come for it).
      const refused = await asample(1);
      expect(refused.status).to.equal(429);
      expect(await redis.smembers(keys.pending)).to.deep.equal([first.json.request_id]);
      // The first ends (through BullMQ alone); the resend is queued and ends too.
      await (await ghost.take()).moveToCompleted(RESULT, ghost.token, false);
      const resent = await asample(1);
      expect(resent.status).to.equal(200);
      await (await ghost.take()).moveToCompleted(RESULT, ghost.token, false);
      const ids = [first.json.request_id, resent.json.request_id];
      const seen: string[] = [];
      let cursor = 0;
      while (new Set(seen).size < 2) {
        const page = (await call(s.baseUrl, 'POST', '/retrieve_futures', { target: { sampling_session_id: session }, prev_cursor: cursor })).json;
        seen.push(...page.completions.map((c: { request_id: string }) => c.request_id));
        cursor = page.cursor;
      }
      expect([...seen].sort()).to.deep.equal([...ids].sort());
      expect(await redis.scard(keys.pending)).to.equal(0);
    });
  });
});
