import { expect } from 'chai';
import { Redis } from 'ioredis';
import { TINY_MODEL_ALIAS } from '../scripts/stack.js';
import { awaitFuture, call, REDIS_URL, startStack, type HttpReply, type TestStack } from './helpers/stack.js';
import { encodeForwardBackward, encodeForwardBackwardMessage, f32, i32, i64 } from './helpers/wire.js';
import { waitFor } from './helpers/procs.js';

/**
 * Bounds the API holds before any allocation or any state: tensor sizes against the model's
 * context and vocabulary, seq_ids within a window, a replay with another payload refused, a gap
 * that times out, results that leave Redis once read. The tiny model: context 2048, vocabulary 1029.
 */
describe('bounds', function () {
  this.timeout(300_000);
  let s: TestStack;
  let sessionId: string;
  let redis: Redis;
  const adam = { learning_rate: 0.01, beta1: 0.9, beta2: 0.95, eps: 1e-12, weight_decay: 0, grad_clip_norm: 0 };
  const batch = [{ tokens: [5, 17, 42], targets: [17, 42, 99], weights: [1, 1, 1] }];

  // Long: the gap test tells a wake at the gap's deadline (1.5 s) from the end of the long poll.
  const LONG_POLL_MS = 30_000;
  before(async () => {
    s = await startStack({ longPollMs: LONG_POLL_MS, env: { TB_SEQ_WINDOW: '64', TB_SEQ_GAP_TIMEOUT_S: '1.5', TB_RESULT_TTL_AFTER_READ_S: '1', TB_MAX_TRAIN_BODY_MB: '2' } });
    sessionId = (await call(s.baseUrl, 'POST', '/create_session', { tags: [] })).json.session_id;
    redis = new Redis(REDIS_URL);
  });
  after(async () => {
    redis?.disconnect();
    await s?.stop();
  });

  let modelSeq = 0;
  async function createModel(): Promise<string> {
    const r = await call(s.baseUrl, 'POST', '/create_model', { session_id: sessionId, model_seq_id: modelSeq++, base_model: TINY_MODEL_ALIAS, lora_config: { rank: 2, seed: 0 } });
    await awaitFuture(s.baseUrl, r.json.request_id);
    return r.json.model_id;
  }
  const fb = (modelId: string, seqId: number, data = batch) =>
    call(s.baseUrl, 'POST', '/forward_backward', undefined, { raw: encodeForwardBackward({ modelId, seqId, data }) });
  const optim = (modelId: string, seqId: number, lr = 0.01) => call(s.baseUrl, 'POST', '/optim_step', { model_id: modelId, seq_id: seqId, adam_params: { ...adam, learning_rate: lr } });
  function refused(r: HttpReply, pattern: RegExp): void {
    expect(r.status, JSON.stringify(r.json)).to.equal(400);
    expect(r.json).to.include({ category: 'user' });
    expect(r.json.error).to.match(pattern);
  }

  it('refuses the 139-byte request claiming a sparse [1, 4e7] tensor at once, without allocating it', async () => {
    const id = await createModel();
    const hostile = (shape: number[]) =>
      encodeForwardBackwardMessage({
        model_id: id,
        seq_id: 1,
        loss_fn: 'cross_entropy',
        data: [
          {
            model_input: [{ encoded_text: { tokens: i32([5]) } }],
            loss_fn_inputs: {
              target_tokens: { sparse_csr: { values: Buffer.alloc(0), crow_indices: i64([0, 0]), col_indices: Buffer.alloc(0) }, dtype: 2, shape },
            },
          },
        ],
      });
    const body = hostile([1, 4e7]);
    expect(body.length).to.be.below(200);
    const rssBefore = process.memoryUsage().rss;
    for (let i = 0; i < 20; i++) {
      const r = await call(s.baseUrl, 'POST', '/forward_backward', undefined, { raw: body });
      refused(r, /target_tokens: shape \[1, 40000000\] is wider than 128/);
    }
    const grew = (process.memoryUsage().rss - rssBefore) / 2 ** 20;
    // 4e7 doubles are 320 MB each; refused before allocating, 20 of them cost nothing. What a refusal
    // costs in time is bench/hostile.ts's figure (docs/benchmarks.md, The API under hostile sizes).
    expect(grew, `rss grew ${grew.toFixed(0)} MiB`).to.be.below(64);
    refused(await call(s.baseUrl, 'POST', '/forward_backward', undefined, { raw: hostile([4e7, 1]) }), /target_tokens has shape \[40000000, 1\] but model_input has 1 tokens/);
    // The refusals used up seq_id 1 (as the SDK expects); the model goes on at seq_id 2.
    const ok = await fb(id, 2);
    expect((await awaitFuture(s.baseUrl, ok.json.request_id)).json.metrics['loss:sum']).to.be.a('number');
  });

  it('refuses dense shapes past the bounds, and datums longer than the context, before decoding them', async () => {
    const id = await createModel();
    const dense = (shape: number[], n = 1) =>
      encodeForwardBackwardMessage({
        model_id: id,
        seq_id: 1,
        loss_fn: 'cross_entropy',
        data: [{ model_input: [{ encoded_text: { tokens: i32(Array(n).fill(5)) } }], loss_fn_inputs: { target_tokens: { dense: i64([1]), dtype: 2, shape } } }],
      });
    refused(await call(s.baseUrl, 'POST', '/forward_backward', undefined, { raw: dense([1, 1e9]) }), /wider than 128/);
    refused(await call(s.baseUrl, 'POST', '/forward_backward', undefined, { raw: dense([1, 2, 3]) }), /must be \(N,\) or \(N, K\)/);
    refused(await call(s.baseUrl, 'POST', '/forward_backward', undefined, { raw: dense([1, 2]) }), /needs 2 elements, got 1/);
    const long = Array.from({ length: 2049 }, (_, i) => i % 1000);
    refused(await fb(id, 2, [{ tokens: long, targets: long, weights: long.map(() => 1) }]), /data\[0\]: 2049 tokens exceed the model's context length of 2048/);
    // A body past TB_MAX_TRAIN_BODY_MB (2 MiB here) is refused before it is buffered.
    const huge = Buffer.alloc(3 * 2 ** 20, 1);
    refused(await call(s.baseUrl, 'POST', '/forward_backward', undefined, { raw: huge }), /request body too large \(limit 2097152 bytes\)/);
    // Floats in a (N,) weights tensor of the right length are fine; K up to 128 is accepted.
    const k = 128;
    const wide = encodeForwardBackwardMessage({
      model_id: id,
      seq_id: 3,
      loss_fn: 'cross_entropy',
      data: [
        {
          model_input: [{ encoded_text: { tokens: i32([5, 6]) } }],
          loss_fn_inputs: {
            target_tokens: { dense: i64(Array(2 * k).fill(7)), dtype: 2, shape: [2, k] },
            weights: { dense: f32(Array(2 * k).fill(1 / k)), dtype: 1, shape: [2, k] },
          },
        },
      ],
    });
    const r = await call(s.baseUrl, 'POST', '/forward_backward', undefined, { raw: wide });
    expect(r.status, JSON.stringify(r.json)).to.equal(200);
    expect((await awaitFuture(s.baseUrl, r.json.request_id)).json.metrics['loss:sum']).to.be.a('number');
  });

  it('watches a body past 1 MiB while it arrives: a datum past every served context is refused from its first bytes, a valid one trains', async () => {
    const id = await createModel();
    // 400k tokens (1.6 MB; the limit here is 2 MiB): refused once the datum's token length has
    // arrived, its seq_id used up as for the route's own refusals.
    const long = Array.from({ length: 400_000 }, (_, i) => i % 1000);
    const hostile = encodeForwardBackward({ modelId: id, seqId: 1, data: [{ tokens: long, targets: [1] }] });
    expect(hostile.length).to.be.within(2 ** 20, 2 * 2 ** 20);
    refused(await call(s.baseUrl, 'POST', '/forward_backward', undefined, { raw: hostile }), /^forward_backward: data\[0\]: 400000 tokens or more exceed the longest context served here \(2048\)$/);
    // One datum of 800 tokens with (800, 128) top-K targets and weights (1.2 MB): watched, within the
    // bounds, decoded by the route and run.
    const [n, k] = [800, 128];
    const wide = encodeForwardBackwardMessage({
      model_id: id,
      seq_id: 2,
      loss_fn: 'cross_entropy',
      data: [
        {
          model_input: [{ encoded_text: { tokens: i32(Array.from({ length: n }, (_, i) => i % 1000)) } }],
          loss_fn_inputs: {
            target_tokens: { dense: i64(Array.from({ length: n * k }, (_, i) => i % 1000)), dtype: 2, shape: [n, k] },
            weights: { dense: f32(Array(n * k).fill(1 / k)), dtype: 1, shape: [n, k] },
          },
        },
      ],
    });
    expect(wide.length).to.be.within(2 ** 20, 2 * 2 ** 20);
    const ok = await call(s.baseUrl, 'POST', '/forward_backward', undefined, { raw: wide });
    expect(ok.status, JSON.stringify(ok.json)).to.equal(200);
    expect((await awaitFuture(s.baseUrl, ok.json.request_id)).json.metrics['loss:sum']).to.be.a('number');
  });

  it('refuses seq_ids beyond the window, and a replay with another payload; a true replay gets the same future', async () => {
    const id = await createModel();
    refused(await optim(id, 65), /seq_id 65 .* too far ahead: the next op to run is seq_id 1, and at most 64/);
    refused(await optim(id, 1e12), /too far ahead/);
    // A refused request leaves nothing in Redis (no future, nothing held).
    expect(await redis.keys(`${s.prefix}:future-owner:*-65`)).to.deep.equal([]);
    expect(await redis.hlen(`${s.prefix}:gate:${id}:held`)).to.equal(0);
    const first = await fb(id, 1);
    expect((await fb(id, 1)).json.request_id).to.equal(first.json.request_id);
    refused(await fb(id, 1, [{ tokens: [5, 17, 43], targets: [17, 43, 99], weights: [1, 1, 1] }]), /seq_id 1 .* already submitted with a different request/);
    refused(await optim(id, 2, 1.0).then(async () => optim(id, 2, 0.5)), /different request/);
    expect((await awaitFuture(s.baseUrl, (await optim(id, 2, 1.0)).json.request_id)).json.type).to.equal('optim_step');
    // Nothing was held for the refused ones: seq_id 3 runs at once.
    expect((await awaitFuture(s.baseUrl, (await fb(id, 3)).json.request_id)).json.metrics).to.be.an('object');
  });

  it('fails ops held behind a gap with a clear error once it times out, and lets the model go on', async () => {
    const id = await createModel();
    const t0 = Date.now();
    const held = await optim(id, 2);
    const r = await awaitFuture(s.baseUrl, held.json.request_id);
    const waited = Date.now() - t0;
    expect(r.json).to.include({ category: 'user', code: 'INVALID_REQUEST' });
    expect(r.json.error).to.match(/^not run: seq_id 1 of model .* never reached the server within 1.5 s, so this op \(seq_id 2\)/);
    // Bounds from the configuration, not from speed: not before the 1.5 s gap timeout (the gap opened
    // after t0; 10 ms for clock reads), and at the gap's deadline, before the 30 s long poll ends.
    expect(waited).to.be.within(1_490, LONG_POLL_MS);
    // The late op finds its failure; later ops run.
    const late = await fb(id, 1);
    expect((await awaitFuture(s.baseUrl, late.json.request_id)).json.error).to.match(/did not reach the server within 1.5 s/);
    expect((await awaitFuture(s.baseUrl, (await fb(id, 3)).json.request_id)).json.metrics).to.be.an('object');
  });

  it('drops a training result and its payload from Redis once read (after the read TTL), keeping create_model', async () => {
    const id = await createModel();
    const sub = await fb(id, 1);
    const [queue, jobId] = (sub.json.request_id as string).split('/') as [string, string];
    const key = `${s.prefix}-bull:${queue}:${jobId}`;
    expect((await awaitFuture(s.baseUrl, sub.json.request_id)).status).to.equal(200);
    // The answer comes first; the record, whose script sets the read-once expiry, follows it (queues/runtime/outcomes.ts).
    const ttl = await waitFor(
      'the read-once expiry',
      async () => {
        const t = await redis.pttl(key);
        return t === -1 ? null : t;
      },
      2_000,
      10,
    );
    expect(ttl).to.be.within(1, 1_000);
    expect(await redis.pttl(`${s.prefix}:future-owner:${sub.json.request_id}`)).to.be.within(1, 1_000);
    await new Promise((r) => setTimeout(r, ttl + 100));
    expect(await redis.exists(key)).to.equal(0);
    const gone = await call(s.baseUrl, 'POST', '/retrieve_future', { request_id: sub.json.request_id });
    expect(gone.status).to.equal(404);
    // A repeat of the seq_id is still recognised by the gate (not run again).
    expect((await fb(id, 1)).json.request_id).to.equal(sub.json.request_id);
    const create = `${s.prefix}-bull:${queue}:c-`;
    const keys = await redis.keys(`${create}*`);
    expect(keys.length).to.be.greaterThan(0);
    for (const k of keys.filter((k) => !k.includes(':', create.length))) expect(await redis.pttl(k)).to.equal(-1);
  });

  it('refuses a sample replay (same sampling session and seq_id) with another prompt; a true replay gets the same future', async () => {
    const ss = (await call(s.baseUrl, 'POST', '/create_sampling_session', { session_id: sessionId, sampling_session_seq_id: 0, base_model: TINY_MODEL_ALIAS })).json.sampling_session_id;
    const sample = (tokens: number[]) =>
      call(s.baseUrl, 'POST', '/asample', { num_samples: 1, prompt: { chunks: [{ type: 'encoded_text', tokens }] }, sampling_params: { max_tokens: 2, seed: 1 }, sampling_session_id: ss, seq_id: 7 });
    const first = await sample([5, 17]);
    expect(first.status).to.equal(200);
    expect((await sample([5, 17])).json.request_id).to.equal(first.json.request_id);
    refused(await sample([5, 18]), /seq_id 7 of sampling session .* already used by a different sample request/);
    expect((await awaitFuture(s.baseUrl, first.json.request_id)).status).to.equal(200);
  });
});
