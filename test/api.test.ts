import { existsSync, mkdirSync, writeFileSync } from 'node:fs';
import path from 'node:path';
import { expect } from 'chai';
import { sweepExpiredCheckpoints } from '../api/services/checkpoints.js';
import { Liveness } from '../queues/runtime/liveness.js';
import { Outcomes } from '../queues/runtime/outcomes.js';
import type { AgentRecord } from '../queues/registry/agents.js';
import { TINY_MODEL_ALIAS, TINY_MODEL_DIR } from '../scripts/stack.js';
import { awaitFuture, call, startStack, type HttpReply, type TestStack } from './helpers/stack.js';
import { decodeForwardBackwardOutput, decodeSampleResponse, encodeForwardBackward, type TestDatum } from './helpers/wire.js';

const PROTO = 'application/x-protobuf';

function expectTinkerError(r: HttpReply, status: number, category: 'user' | 'server', pattern: RegExp): void {
  expect(r.status, JSON.stringify(r.json)).to.equal(status);
  expect(r.json).to.include({ category });
  expect(r.json.error).to.be.a('string').and.match(pattern);
}

describe('API without a worker agent', () => {
  let s: TestStack;
  before(async () => {
    s = await startStack({ agent: false, longPollMs: 500 });
  });
  after(async () => s?.stop());

  it('reports not ready on /healthz until an agent serves a model', async () => {
    const r = await call(s.baseUrl, 'GET', '/healthz', undefined, { key: null });
    expect(r.status).to.equal(503);
    expect(r.json.status).to.equal('starting');
  });

  it('is not ready on a dead agent\'s leftover liveness key (a node killed and restarting): only a recent heartbeat counts', async () => {
    const { redis, names } = s.built.ctx;
    const liveness = new Liveness(redis, names, s.built.ctx.registry.models, new Outcomes(redis, names, 60));
    const rec: AgentRecord = {
      agent_id: 'dead-or-alive', train_queue: names.trainQueue('dead-or-alive'), engine: 'torch', device: 'cpu', started_at: new Date().toISOString(), timeout_s: 30,
      models: [{ name: '/m', aliases: ['m'], arch: 'Qwen3ForCausalLM', vocab_size: 16, max_context_length: 64, trainable: true, lora_max_rank: 8, topk_max: 4 }],
    };
    try {
      expect(await liveness.beat(rec, 'inc-1')).to.equal('ok');
      expect((await call(s.baseUrl, 'GET', '/healthz', undefined, { key: null })).json.status).to.equal('ready');
      // The same key as a killed incarnation leaves it: its last beat 20 s ago (Redis's clock), its TTL (30 s) not run out.
      const [sec] = await redis.time();
      await redis.set(names.agentAlive(rec.agent_id), `inc-1 ${Number(sec) * 1000 - 20_000}`, 'PX', 10_000);
      const r = await call(s.baseUrl, 'GET', '/healthz', undefined, { key: null });
      expect(r.status).to.equal(503);
      expect(r.json.status).to.equal('starting');
      // Placement still sees it until the reaper acts (its key exists): only /healthz asks for a recent beat.
      expect((await s.built.ctx.registry.agents.live()).map((a) => a.agent_id)).to.include(rec.agent_id);
    } finally {
      await redis.del(names.agentAlive(rec.agent_id));
      await redis.hdel(names.agents(), rec.agent_id);
    }
  });

  it('bounds every client field it stores (tags, user_metadata, versions): a 400 naming the field, nothing stored', async () => {
    const { redis, names } = s.built.ctx;
    const before = (await redis.keys(`${names.prefix}:session:*`)).length;
    const big = { blob: 'x'.repeat(1 << 20) };
    const refused: [unknown, RegExp][] = [
      [{ tags: Array.from({ length: 65 }, (_, i) => `t${i}`) }, /tags: at most 64 tags/],
      [{ tags: ['x'.repeat(257)] }, /tags\.0: a tag has at most 256 characters/],
      [{ tags: [], user_metadata: big }, /user_metadata: at most 16384 bytes as JSON/],
      [{ tags: [], user_metadata: Object.fromEntries(Array.from({ length: 65 }, (_, i) => [`k${i}`, 'v'])) }, /user_metadata: at most 64 entries/],
      [{ tags: [], user_metadata: { ['k'.repeat(129)]: 'v' } }, /a user_metadata key has at most 128 characters/],
      [{ tags: [], sdk_version: 'v'.repeat(300) }, /sdk_version: at most 256 characters/],
    ];
    for (const [body, why] of refused) expectTinkerError(await call(s.baseUrl, 'POST', '/create_session', body), 400, 'user', why);
    expectTinkerError(await call(s.baseUrl, 'POST', '/create_model', { session_id: 's', model_seq_id: 0, base_model: 'm', user_metadata: big }), 400, 'user', /user_metadata: at most 16384 bytes/);
    expect((await redis.keys(`${names.prefix}:session:*`)).length).to.equal(before);
    // At the bounds, accepted.
    const ok = await call(s.baseUrl, 'POST', '/create_session', { tags: Array.from({ length: 64 }, () => 'x'.repeat(256)), user_metadata: { k: 'v'.repeat(16_000) } });
    expect(ok.status, JSON.stringify(ok.json)).to.equal(200);
  });

  it('answers 401 in the Tinker error shape for a missing or wrong API key', async () => {
    expectTinkerError(await call(s.baseUrl, 'POST', '/create_session', {}, { key: null }), 401, 'user', /missing X-API-Key/);
    expectTinkerError(await call(s.baseUrl, 'POST', '/create_session', {}, { key: 'tml-wrong' }), 401, 'user', /invalid API key/);
  });

  it('answers 400 with a message naming the problem for malformed bodies', async () => {
    expectTinkerError(await call(s.baseUrl, 'POST', '/create_session', '{"tags": [', {}), 400, 'user', /malformed JSON/);
    expectTinkerError(await call(s.baseUrl, 'POST', '/create_model', { session_id: 'x' }), 400, 'user', /model_seq_id.*base_model|base_model/);
    expectTinkerError(
      await call(s.baseUrl, 'POST', '/create_model', { session_id: 'x', model_seq_id: 0, base_model: 'm', lora_config: { rank: -4 } }),
      400,
      'user',
      /lora_config\.rank/,
    );
    const garbled = await call(s.baseUrl, 'POST', '/forward_backward', undefined, { raw: Buffer.from([0xff, 0xff, 0xff]) });
    expectTinkerError(garbled, 400, 'user', /not a valid ForwardBackwardRequest: this route takes the Tinker SDK's protobuf body \(Content-Type: application\/x-protobuf\)/);
    expect(garbled.json.error).to.not.match(/index out of range|wire type/);
    // A JSON body (a client written by hand): the route names what it takes, not the decoder's internals.
    const asJson = await call(s.baseUrl, 'POST', '/forward_backward', { model_id: 'm', seq_id: 1, forward_backward_input: { data: [], loss_fn: 'cross_entropy' } });
    expectTinkerError(asJson, 400, 'user', /takes the Tinker SDK's protobuf ForwardBackwardRequest body \(Content-Type: application\/x-protobuf\), not application\/json/);
    expect(asJson.json.error).to.not.match(/index out of range/);
    expectTinkerError(await call(s.baseUrl, 'POST', '/optim_step', { model_id: 'm', seq_id: 1 }), 400, 'user', /adam_params: required/);
  });

  it('answers unknown sessions, models and futures with user errors, not 500s', async () => {
    expectTinkerError(await call(s.baseUrl, 'POST', '/get_info', { model_id: 'nope:train:0' }), 404, 'user', /unknown model_id/);
    expectTinkerError(
      await call(s.baseUrl, 'POST', '/create_model', { session_id: 'nope', model_seq_id: 0, base_model: 'm', lora_config: { rank: 4 } }),
      404,
      'user',
      /unknown session/,
    );
    const sess = await call(s.baseUrl, 'POST', '/create_session', { tags: [], sdk_version: '0.38.0' });
    expectTinkerError(
      await call(s.baseUrl, 'POST', '/create_model', { session_id: sess.json.session_id, model_seq_id: 0, base_model: 'Qwen/Qwen3-8B', lora_config: { rank: 4 } }),
      404,
      'user',
      /base model 'Qwen\/Qwen3-8B' is not served here/,
    );
    const fb = encodeForwardBackward({ modelId: 'nope:train:0', seqId: 1, data: [{ tokens: [1, 2], targets: [2, 3] }] });
    expectTinkerError(await call(s.baseUrl, 'POST', '/forward_backward', undefined, { raw: fb }), 404, 'user', /unknown model_id/);
    expectTinkerError(await call(s.baseUrl, 'POST', '/retrieve_future', { request_id: 'train-x/t-abc-1' }), 404, 'user', /unknown or expired future/);
    // Ids naming BullMQ's own keys (a stream, a hash of another type) are unknown futures, not WRONGTYPE 500s.
    for (const id of ['train-x/events', 'train-x/meta', 'train-x/id', 'train-x/wait', 'sample-x/events'])
      expectTinkerError(await call(s.baseUrl, 'POST', '/retrieve_future', { request_id: id }), 404, 'user', /unknown or expired future/);
    expectTinkerError(await call(s.baseUrl, 'POST', '/no_such_endpoint', {}), 404, 'user', /no such endpoint/);
  });
});

describe('API with a worker agent and the tiny model', function () {
  this.timeout(300_000);
  let s: TestStack;
  let sessionId: string;

  before(async () => {
    s = await startStack({ longPollMs: 1_500 });
    sessionId = (await call(s.baseUrl, 'POST', '/create_session', { tags: [], sdk_version: '0.38.0' })).json.session_id;
  });
  after(async () => s?.stop());

  const result = (requestId: string, accept?: string) => awaitFuture(s.baseUrl, requestId, accept);

  let modelSeq = 0;
  async function createModel(seed: number): Promise<string> {
    const r = await call(s.baseUrl, 'POST', '/create_model', {
      session_id: sessionId,
      model_seq_id: modelSeq++,
      base_model: TINY_MODEL_ALIAS,
      lora_config: { rank: 4, seed },
      type: 'create_model',
    });
    expect(r.status, JSON.stringify(r.json)).to.equal(200);
    const done = await result(r.json.request_id);
    expect(done.json).to.deep.equal({ type: 'create_model', model_id: r.json.model_id });
    return r.json.model_id;
  }

  const batch: TestDatum[] = [
    { tokens: [5, 17, 42, 99, 7], targets: [17, 42, 99, 7, 300], weights: [1, 1, 1, 1, 1] },
    { tokens: [11, 12, 13], targets: [12, 13, 14], weights: [0, 1, 1] },
  ];

  function submitFb(modelId: string, seqId: number, forwardOnly = false): Promise<HttpReply> {
    return call(s.baseUrl, 'POST', '/forward_backward', undefined, { raw: encodeForwardBackward({ modelId, seqId, data: batch, forwardOnly }) });
  }
  function submitOptim(modelId: string, seqId: number): Promise<HttpReply> {
    return call(s.baseUrl, 'POST', '/optim_step', {
      model_id: modelId,
      seq_id: seqId,
      adam_params: { learning_rate: 0.05, beta1: 0.9, beta2: 0.95, eps: 1e-12, weight_decay: 0, grad_clip_norm: 0 },
      type: 'optim_step',
    });
  }
  async function fbOutput(requestId: string) {
    const r = await result(requestId, PROTO);
    expect(r.headers.get('content-type')).to.include(PROTO);
    return decodeForwardBackwardOutput(r.body);
  }

  it('reports ready on /healthz and lists the model in the capabilities', async () => {
    const h = await call(s.baseUrl, 'GET', '/healthz', undefined, { key: null });
    expect(h.status).to.equal(200);
    expect(h.json).to.deep.equal({ status: 'ready', models: 1 }); // open without a key: no model paths
    const caps = await call(s.baseUrl, 'GET', '/get_server_capabilities');
    expect(caps.json.supported_models).to.deep.include({ model_name: TINY_MODEL_DIR, max_context_length: 2048, trainable: true, sampleable: true });
  });

  it('creates a model by alias and by path, and get_info names the tokenizer by its path', async () => {
    const id = await createModel(1);
    const info = await call(s.baseUrl, 'POST', '/get_info', { model_id: id, type: 'get_info' });
    expect(info.json.model_data).to.deep.include({ model_name: TINY_MODEL_DIR, tokenizer_id: TINY_MODEL_DIR });
    expect(info.json).to.include({ is_lora: true, lora_rank: 4 });
    const r = await call(s.baseUrl, 'POST', '/create_model', { session_id: sessionId, model_seq_id: modelSeq++, base_model: TINY_MODEL_DIR, lora_config: { rank: 2 } });
    expect((await result(r.json.request_id)).json.model_id).to.equal(r.json.model_id);
  });

  it('resolves a future by long-poll as soon as its job completes, without try_again', async () => {
    const id = await createModel(2);
    const sub = await submitFb(id, 1, true);
    // One call answers with the result, and its long poll did not run to its 1.5 s timeout: a wait
    // that runs out reaches `signalled` with no wake-up (api/futures.ts retrieve).
    const futures = s.built.ctx.futures as unknown as { signalled: (ref: unknown, wake: unknown) => unknown };
    const signalled = futures.signalled;
    expect(signalled).to.be.a('function');
    let ranOut = 0;
    futures.signalled = function (this: unknown, ref: unknown, wake: unknown) {
      if (wake === undefined) ranOut++;
      return signalled.call(this, ref, wake);
    };
    let r: HttpReply;
    try {
      r = await call(s.baseUrl, 'POST', '/retrieve_future', { request_id: sub.json.request_id }, { accept: PROTO });
    } finally {
      futures.signalled = signalled;
    }
    expect(r.headers.get('content-type')).to.include(PROTO);
    expect(ranOut, 'long polls that ran to their timeout').to.equal(0);
    const out = decodeForwardBackwardOutput(r.body);
    expect(out.logprobs.map((l) => l.length)).to.deep.equal([5, 3]);
    const nll = -out.logprobs.flatMap((l, i) => l.map((v, j) => v * batch[i]!.weights![j]!)).reduce((a, b) => a + b, 0);
    expect(out.metrics['loss:sum']).to.be.closeTo(nll, 1e-4);
  });

  it('answers try_again while an op waits behind a seq_id gap', async () => {
    const id = await createModel(3);
    const sub = await submitOptim(id, 2);
    const r = await call(s.baseUrl, 'POST', '/retrieve_future', { request_id: sub.json.request_id });
    expect(r.json).to.deep.equal({ type: 'try_again', request_id: sub.json.request_id, queue_state: 'active' });
    await submitFb(id, 1);
    expect((await result(sub.json.request_id)).json.type).to.equal('optim_step');
  });

  it('runs training ops in seq_id order when they arrive out of order, and de-duplicates a repeated seq_id', async () => {
    // Same seed: same LoRA init. Model A gets seq 3, 2, 1 (each submission answered before the next is sent);
    // model B gets 1, 2, 3 one at a time. Seq 3 is a forward after the optimizer step of seq 2.
    const a = await createModel(7);
    const b = await createModel(7);
    const a3 = await submitFb(a, 3, true);
    const a2 = await submitOptim(a, 2);
    const a1 = await submitFb(a, 1);
    const again = await submitFb(a, 1);
    expect(again.json.request_id).to.equal(a1.json.request_id);

    const b1 = await fbOutput((await submitFb(b, 1)).json.request_id);
    await result((await submitOptim(b, 2)).json.request_id);
    const b3 = await fbOutput((await submitFb(b, 3, true)).json.request_id);

    const [o1, o2, o3] = [await fbOutput(a1.json.request_id), await result(a2.json.request_id), await fbOutput(a3.json.request_id)];
    expect(o2.json.type).to.equal('optim_step');
    o1.logprobs.flat().forEach((v, i) => expect(v).to.be.closeTo(b1.logprobs.flat()[i]!, 1e-5));
    o3.logprobs.flat().forEach((v, i) => expect(v).to.be.closeTo(b3.logprobs.flat()[i]!, 1e-5));
    // The step changed the weights: seq 3 saw them, so its loss is lower than seq 1's.
    expect(o3.metrics['loss:sum']).to.be.below(o1.metrics['loss:sum']! - 1e-3);
  });

  it("fails an op of a model lost or expired since this API process last read its record, as without that copy", async () => {
    const id = await createModel(8);
    await result((await submitFb(id, 1)).json.request_id); // the API keeps a copy of the model's record
    const models = s.built.ctx.registry.models;
    await models.markLost(id, 'its engine died (test)');
    const lost = await result((await submitOptim(id, 2)).json.request_id);
    expect(lost.json, JSON.stringify(lost.json)).to.include({ category: 'server', code: 'UNAVAILABLE' });
    expect(lost.json.error).to.include(`model ${id} is unavailable: its engine died (test)`);
    // Expired: answered as an unknown model, whichever copy the process held.
    const other = await createModel(9);
    await result((await submitFb(other, 1)).json.request_id);
    await s.built.ctx.redis.del(s.built.ctx.names.model(other));
    expectTinkerError(await submitOptim(other, 2), 404, 'user', /unknown model_id/);
  });

  it('samples from saved sampler weights with a logprob for every token', async () => {
    const id = await createModel(4);
    await result((await submitFb(id, 1)).json.request_id);
    await result((await submitOptim(id, 2)).json.request_id);
    const save = await call(s.baseUrl, 'POST', '/save_weights_for_sampler', { model_id: id, seq_id: 3, sampling_session_seq_id: 0 });
    const saved = await result(save.json.request_id);
    expect(saved.json.sampling_session_id).to.equal(`${sessionId}:sample:0`);
    const sampler = await call(s.baseUrl, 'GET', `/samplers/${encodeURIComponent(saved.json.sampling_session_id)}`);
    expect(sampler.json).to.include({ base_model: TINY_MODEL_DIR });
    const sub = await call(s.baseUrl, 'POST', '/asample', {
      num_samples: 3,
      prompt: { chunks: [{ type: 'encoded_text', tokens: [5, 17, 42] }] },
      sampling_params: { max_tokens: 6, seed: 3, temperature: 1, top_k: -1, top_p: 1, stop: [] },
      sampling_session_id: saved.json.sampling_session_id,
      seq_id: 0,
      prompt_logprobs: true,
      topk_prompt_logprobs: 0,
      type: 'sample',
    });
    expect(sub.json.sample_sequence_ids).to.have.length(3);
    const r = await result(sub.json.request_id, PROTO);
    const out = decodeSampleResponse(r.body);
    expect(out.sequences).to.have.length(3);
    for (const seq of out.sequences) {
      expect(seq.tokens).to.have.length(6);
      expect(seq.logprobs).to.have.length(6);
      expect(seq.stop_reason).to.equal(1); // length: stop [] disables EOS
      for (const lp of seq.logprobs) expect(lp).to.be.at.most(0);
    }
    expect(out.promptLogprobs).to.have.length(3);
    expect(Number.isNaN(out.promptLogprobs![0])).to.equal(true);
  });

  it('fails the future with category server and the engine message when the engine raises, and keeps serving', async () => {
    const id = await createModel(5);
    // A plain file where the checkpoint directory must go makes the engine's save raise.
    const modelDir = path.join(s.storageDir, id.replace(/[^A-Za-z0-9._-]/g, '_'));
    mkdirSync(modelDir, { recursive: true });
    writeFileSync(path.join(modelDir, 'sampler_weights'), 'not a directory');
    const save = await call(s.baseUrl, 'POST', '/save_weights_for_sampler', { model_id: id, seq_id: 1, path: 'blocked' });
    const failed = await result(save.json.request_id);
    expect(failed.status).to.equal(200);
    expect(failed.json).to.include({ category: 'server', code: 'ENGINE_FAILED' });
    expect(failed.json.error).to.match(/sampler_weights/);
    // The next op of the same model runs.
    const out = await fbOutput((await submitFb(id, 2)).json.request_id);
    expect(out.logprobs).to.have.length(2);
  });

  it('fails with a user error when the engine rejects input the API let through', async () => {
    const id = await createModel(6);
    // ppo with a per-token clip threshold <= 0: the engine checks the per-token values.
    const raw = encodeForwardBackward({
      modelId: id,
      seqId: 1,
      lossFn: 'ppo',
      data: [{ tokens: [1, 2, 3], targets: [2, 3, 4], logprobs: [-1, -1, -1], advantages: [1, -1, 0.5], clipHigh: [1.2, -1, 1.2] }],
    });
    const sub = await call(s.baseUrl, 'POST', '/forward_backward', undefined, { raw });
    const r = await result(sub.json.request_id, PROTO);
    expect(r.json).to.include({ category: 'user', code: 'INVALID_REQUEST' });
    expect(r.json.error).to.match(/clip_high_threshold must be > 0/);
  });

  it('refuses a loss_fn_config the loss catalogue does not allow before queueing, with the engine\'s message; the seq_id is used up', async () => {
    const id = await createModel(6);
    const datum = { tokens: [1, 2, 3], targets: [2, 3, 4], logprobs: [-1, -1, -1], advantages: [1, -1, 0.5] };
    const refused: [string, Record<string, number>, RegExp][] = [
      ['ppo', { clip_low_threshold: 2.0, clip_high_threshold: 0.5 }, /loss_fn_config: clip_low_threshold must not exceed clip_high_threshold/],
      ['ppo', { epsilon: 0.2 }, /loss_fn_config for 'ppo' has unknown keys \['epsilon'\]; accepted: clip_high_threshold, clip_low_threshold/],
      ['dro', {}, /loss 'dro' requires loss_fn_config\['beta'\]/],
    ];
    for (const [i, [lossFn, config, message]] of refused.entries()) {
      const raw = encodeForwardBackward({ modelId: id, seqId: i + 1, lossFn, config, data: [datum] });
      const sub = await call(s.baseUrl, 'POST', '/forward_backward', undefined, { raw });
      expect(sub.status, JSON.stringify(sub.json)).to.equal(400);
      expect(sub.json).to.include({ category: 'user', code: 'INVALID_REQUEST' });
      expect(sub.json.error).to.match(message);
    }
    // The refused requests used up seq_ids 1-3: the next op, 4, runs.
    const ok = encodeForwardBackward({ modelId: id, seqId: 4, lossFn: 'dro', config: { beta: 0.1 }, data: [datum] });
    const out = await fbOutput((await call(s.baseUrl, 'POST', '/forward_backward', undefined, { raw: ok })).json.request_id);
    expect(out.logprobs).to.have.length(1);
    expect(out.logprobs[0]).to.have.length(3);
  });

  it('takes optimizer_config adamw, and refuses dimuon (create_model and optim_step) naming what is supported; the refused step uses up its seq_id', async () => {
    const base = { session_id: sessionId, base_model: TINY_MODEL_ALIAS, lora_config: { rank: 4, seed: 3 }, type: 'create_model' };
    expectTinkerError(
      await call(s.baseUrl, 'POST', '/create_model', { ...base, model_seq_id: modelSeq++, optimizer_config: { type: 'dimuon', version: 1 } }),
      400,
      'user',
      /optimizer 'dimuon' is not supported by this server; supported: adamw/,
    );
    const ok = await call(s.baseUrl, 'POST', '/create_model', { ...base, model_seq_id: modelSeq++, optimizer_config: { type: 'adamw' } });
    expect(ok.status, JSON.stringify(ok.json)).to.equal(200);
    const modelId = (await result(ok.json.request_id)).json.model_id as string;
    expectTinkerError(
      await call(s.baseUrl, 'POST', '/optim_step', { model_id: modelId, seq_id: 1, optimizer_params: { type: 'dimuon', learning_rate: 0.01 }, type: 'optim_step' }),
      400,
      'user',
      /optimizer 'dimuon' is not supported by this server; supported: adamw/,
    );
    // The SDK has used up seq_id 1: the model's next op is not held behind it.
    const fb = await submitFb(modelId, 2);
    expect(fb.status, JSON.stringify(fb.json)).to.equal(200);
    expect((await fbOutput(fb.json.request_id)).metrics['loss:sum']).to.be.a('number');
  });

  it('rejects shape mismatches and out-of-vocabulary tokens before they reach the engine', async () => {
    const id = await createModel(8);
    const bad = encodeForwardBackward({ modelId: id, seqId: 1, data: [{ tokens: [1, 2, 3], targets: [2, 3] }] });
    expectTinkerError(await call(s.baseUrl, 'POST', '/forward_backward', undefined, { raw: bad }), 400, 'user', /target_tokens has shape \[2\] but model_input has 3 tokens/);
    const oov = encodeForwardBackward({ modelId: id, seqId: 1, data: [{ tokens: [1, 2, 999999], targets: [2, 3, 4] }] });
    expectTinkerError(await call(s.baseUrl, 'POST', '/forward_backward', undefined, { raw: oov }), 400, 'user', /999999 is outside the vocabulary/);
    const nan = encodeForwardBackward({ modelId: id, seqId: 1, lossFn: 'importance_sampling', data: [{ tokens: [1, 2], targets: [2, 3], logprobs: [-1, -1], advantages: [NaN, 1] }] });
    expectTinkerError(await call(s.baseUrl, 'POST', '/forward_backward', undefined, { raw: nan }), 400, 'user', /advantages contains NaN/);
    // The SDK does not resend a refused request and numbers the next call seq 2: it must run.
    expect((await fbOutput((await submitFb(id, 2)).json.request_id)).logprobs).to.have.length(2);
    const badOptim = await call(s.baseUrl, 'POST', '/optim_step', { model_id: id, seq_id: 3, adam_params: { learning_rate: -1 } });
    expectTinkerError(badOptim, 400, 'user', /adam_params\.learning_rate/);
    const opt = await result((await submitOptim(id, 4)).json.request_id);
    expect(opt.json.type, JSON.stringify(opt.json)).to.equal('optim_step');
  });
});

describe('checkpoints over HTTP', function () {
  this.timeout(120_000);
  let s: TestStack;
  let sessionId: string;
  before(async () => {
    s = await startStack({ longPollMs: 1_000 });
    sessionId = (await call(s.baseUrl, 'POST', '/create_session', { tags: [] })).json.session_id;
  });
  after(async () => s?.stop());
  const result = (requestId: string) => awaitFuture(s.baseUrl, requestId);

  it('lists, expires (TTL) and deletes checkpoints, with their files', async () => {
    const cm = await call(s.baseUrl, 'POST', '/create_model', { session_id: sessionId, model_seq_id: 0, base_model: TINY_MODEL_ALIAS, lora_config: { rank: 2 } });
    const id = (await result(cm.json.request_id)).json.model_id as string;
    const save = (seq: number, name: string, ttl?: number) =>
      call(s.baseUrl, 'POST', '/save_weights', { model_id: id, seq_id: seq, path: name, ...(ttl ? { ttl_seconds: ttl } : {}) });
    expect((await result((await save(1, 'keep')).json.request_id)).json).to.deep.equal({ type: 'save_weights', path: `tinker://${id}/weights/keep` });
    expect((await result((await save(2, 'short', 1)).json.request_id)).json.path).to.equal(`tinker://${id}/weights/short`);
    const sampler = await call(s.baseUrl, 'POST', '/save_weights_for_sampler', { model_id: id, seq_id: 3, path: 'samp' });
    await result(sampler.json.request_id);

    const list = async () =>
      (await call(s.baseUrl, 'GET', `/training_runs/${id}/checkpoints`)).json.checkpoints.map((c: { checkpoint_id: string }) => c.checkpoint_id).sort();
    expect(await list()).to.deep.equal(['sampler_weights/samp', 'weights/keep', 'weights/short']);
    const run = await call(s.baseUrl, 'GET', `/training_runs/${id}`);
    expect(run.json).to.include({ training_run_id: id, is_lora: true, lora_rank: 2 });
    expect(run.json.last_checkpoint.tinker_path).to.match(/weights\/(keep|short)$/);

    const dir = (name: string) => path.join(s.storageDir, id.replace(/[^A-Za-z0-9._-]/g, '_'), 'weights', name);
    expect(existsSync(path.join(dir('short'), 'adapter_model.safetensors'))).to.equal(true);
    await new Promise((r) => setTimeout(r, 1_100));
    // Expired: gone from listings and lookups at once; the sweeper removes the files.
    expect(await list()).to.deep.equal(['sampler_weights/samp', 'weights/keep']);
    expect((await call(s.baseUrl, 'POST', '/weights_info', { tinker_path: `tinker://${id}/weights/short` })).status).to.equal(404);
    expect(await sweepExpiredCheckpoints(s.built.ctx)).to.equal(1);
    expect(existsSync(dir('short'))).to.equal(false);

    const del = await call(s.baseUrl, 'DELETE', `/training_runs/${id}/checkpoints/weights/keep`);
    expect(del.status).to.equal(200);
    expect(existsSync(dir('keep'))).to.equal(false);
    expect(await list()).to.deep.equal(['sampler_weights/samp']);
    expect((await call(s.baseUrl, 'DELETE', `/training_runs/${id}/checkpoints/weights/keep`)).status).to.equal(404);
  });

  it('fails futures with the code of the rule the agent found broken, in the API\'s words (codes cross the queue)', async () => {
    const cm = await call(s.baseUrl, 'POST', '/create_model', { session_id: sessionId, model_seq_id: 1, base_model: TINY_MODEL_ALIAS, lora_config: { rank: 2 } });
    const id = (await result(cm.json.request_id)).json.model_id as string;
    const op = (route: string, body: Record<string, unknown>) => call(s.baseUrl, 'POST', route, { model_id: id, ...body });
    const ckpt = `tinker://${id}/weights/w`;
    await result((await op('/save_weights', { seq_id: 1, path: 'w' })).json.request_id);

    // A load queued behind a gap passes the API's checks; the checkpoint is deleted before it runs.
    const load = await op('/load_weights', { seq_id: 3, path: ckpt, optimizer: true });
    expect(load.status).to.equal(200);
    expect((await call(s.baseUrl, 'DELETE', `/training_runs/${id}/checkpoints/weights/w`)).status).to.equal(200);
    await result((await op('/optim_step', { seq_id: 2, adam_params: {} })).json.request_id);
    const missing = (await result(load.json.request_id)).json;
    expect(missing).to.deep.equal({ error: `checkpoint ${ckpt} does not exist (never saved, deleted or expired)`, category: 'user', code: 'NOT_FOUND' });
    // The API refuses the same load now, with the same words, as an HTTP 404.
    const refused = await op('/load_weights', { seq_id: 4, path: ckpt, optimizer: true });
    expect(refused.status).to.equal(404);
    expect(refused.json).to.deep.equal({ error: missing.error, category: 'user', code: 'NOT_FOUND' });

    // Two saves of one name queued together: the agent refuses the second as the API refuses a third.
    const [a, b] = [await op('/save_weights', { seq_id: 5, path: 'twice' }), await op('/save_weights', { seq_id: 6, path: 'twice' })];
    expect((await result(a.json.request_id)).json.path).to.equal(`tinker://${id}/weights/twice`);
    const second = (await result(b.json.request_id)).json;
    expect(second).to.deep.equal({ error: `checkpoint tinker://${id}/weights/twice already exists; pass overwrite=True to replace it`, category: 'user', code: 'INVALID_REQUEST' });
    const third = await op('/save_weights', { seq_id: 7, path: 'twice' });
    expect(third.status).to.equal(400);
    expect(third.json).to.deep.equal(second);

    // A sampling session pinned to sampler weights that were deleted fails its samples with STALE_SAMPLER.
    await result((await op('/save_weights_for_sampler', { seq_id: 8, path: 'pin' })).json.request_id);
    const ss = await call(s.baseUrl, 'POST', '/create_sampling_session', { session_id: sessionId, sampling_session_seq_id: 0, model_path: `tinker://${id}/sampler_weights/pin` });
    expect((await call(s.baseUrl, 'DELETE', `/training_runs/${id}/checkpoints/sampler_weights/pin`)).status).to.equal(200);
    const sample = await call(s.baseUrl, 'POST', '/asample', {
      sampling_session_id: ss.json.sampling_session_id,
      seq_id: 0,
      prompt: { chunks: [{ tokens: [1, 2] }] },
      sampling_params: { max_tokens: 2 },
    });
    expect((await result(sample.json.request_id)).json).to.include({ category: 'user', code: 'STALE_SAMPLER' });

    // The session's search entry counts its listed checkpoints (weights/twice; `pin` was deleted).
    const found = await call(s.baseUrl, 'POST', '/sessions/search', { session_id: sessionId });
    expect(found.json.sessions.map((x: { checkpoints_count: number }) => x.checkpoints_count)).to.deep.equal([
      (await call(s.baseUrl, 'GET', `/training_runs/${id}/checkpoints`)).json.checkpoints.length +
        (await call(s.baseUrl, 'GET', `/training_runs/${sessionId}:train:0/checkpoints`)).json.checkpoints.length,
    ]);
    expect(found.json.sessions[0].checkpoints_count).to.equal(2);
  });
});
