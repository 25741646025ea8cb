import { rmSync } from 'node:fs';
import { expect } from 'chai';
import { Completions, signalLocally } from '../queues/runtime/completions.js';
import { Names, jobIds } from '../queues/contract/names.js';
import { addSessionFuture, CLONE_SEQ_SPAN, SESSION_FUTURES_MAX, SESSION_FAILURE_MESSAGE_MAX, SESSION_FUTURES_PER_POLL, sessionSignalKey } from '../queues/runtime/session-futures.js';
import { TINY_MODEL_ALIAS } from '../scripts/stack.js';
import { API_KEY_B, awaitFuture, call, REDIS_URL, startStack, type HttpReply, type TestStack } from './helpers/stack.js';
import { Redis } from 'ioredis';

/**
 * retrieve_futures, the SDK's session poller (SDK 0.27+ with `sample_use_retrieve_futures`): per
 * client of a sampling session, the samples that ended since the client's cursor, long-polled;
 * entries at or before the cursor it sends back leave. Real server, agent, engine (tiny model) and Redis.
 */
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
    s = await startStack({ longPollMs: 120_000 });
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
