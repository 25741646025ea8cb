import { spawnSync } from 'node:child_process';
import { expect } from 'chai';
import { assertSafeKeys, StartRefused } from '../api/auth.js';
import { TINY_MODEL_ALIAS } from '../scripts/stack.js';
import { API_KEY, API_KEY_B, awaitFuture, call, startStack, type HttpReply, type TestStack } from './helpers/stack.js';
import { decodeForwardBackwardOutput, encodeForwardBackward } from './helpers/wire.js';

/**
 * Tenants: two API keys against one stack. Tenant B tries every route of the API with tenant A's
 * sessions, models, seq_ids, sampling sessions, checkpoints and futures, and gets exactly what it
 * would get for ids that do not exist; A's run is unharmed. Published checkpoints are readable by
 * B, and only readable.
 */
describe('tenants', function () {
  this.timeout(300_000);
  let s: TestStack;
  const A = { key: API_KEY };
  const B = { key: API_KEY_B };
  const PROTO = 'application/x-protobuf';

  // What A holds.
  let sessA: string;
  let modelA: string;
  let samplerA: string; // sampling session of an ephemeral sampler save
  let samplerNamedA: string; // sampling session on a named sampler version
  const fut: Record<string, string> = {};
  const paths = { sampler: '', weights: '', external: '' };
  let sessB: string;

  const adam = { learning_rate: 0.05, beta1: 0.9, beta2: 0.95, eps: 1e-12, weight_decay: 0, grad_clip_norm: 0 };
  const batch = [{ tokens: [5, 17, 42, 99, 7], targets: [17, 42, 99, 7, 300], weights: [1, 1, 1, 1, 1] }];
  const prompt = { chunks: [{ type: 'encoded_text', tokens: [5, 17, 42] }] };
  const sp = { max_tokens: 3, seed: 1, temperature: 1, top_k: -1, top_p: 1, stop: [] };

  const asA = (method: 'GET' | 'POST' | 'PUT' | 'DELETE', route: string, body?: unknown) => call(s.baseUrl, method, route, body, A);
  const asB = (method: 'GET' | 'POST' | 'PUT' | 'DELETE', route: string, body?: unknown) => call(s.baseUrl, method, route, body, B);
  const resultA = (id: string, accept?: string) => awaitFuture(s.baseUrl, id, accept);
  const ok = (r: HttpReply) => {
    expect(r.status, JSON.stringify(r.json)).to.equal(200);
    return r;
  };
  function notFound(r: HttpReply, what: RegExp): void {
    expect(r.status, JSON.stringify(r.json)).to.equal(404);
    expect(r.json).to.include({ category: 'user' });
    expect(r.json.error).to.match(what);
  }

  before(async () => {
    s = await startStack({ longPollMs: 1_000 });
    sessA = ok(await asA('POST', '/create_session', { tags: ['a'], user_metadata: { who: 'a' } })).json.session_id;
    sessB = ok(await asB('POST', '/create_session', { tags: ['b'] })).json.session_id;
    const cm = ok(await asA('POST', '/create_model', { session_id: sessA, model_seq_id: 0, base_model: TINY_MODEL_ALIAS, lora_config: { rank: 2, seed: 1 } }));
    modelA = cm.json.model_id;
    fut.create = cm.json.request_id;
    await resultA(fut.create!);
    fut.fb = ok(await call(s.baseUrl, 'POST', '/forward_backward', undefined, { ...A, raw: encodeForwardBackward({ modelId: modelA, seqId: 1, data: batch }) })).json.request_id;
    fut.optim = ok(await asA('POST', '/optim_step', { model_id: modelA, seq_id: 2, adam_params: adam })).json.request_id;
    fut.samplerNamed = ok(await asA('POST', '/save_weights_for_sampler', { model_id: modelA, seq_id: 3, path: 's1' })).json.request_id;
    fut.weights = ok(await asA('POST', '/save_weights', { model_id: modelA, seq_id: 4, path: 'w1' })).json.request_id;
    fut.external = ok(await asA('POST', '/save_weights_external', { model_id: modelA, seq_id: 5, path: 'e1' })).json.request_id;
    fut.samplerEph = ok(await asA('POST', '/save_weights_for_sampler', { model_id: modelA, seq_id: 6, sampling_session_seq_id: 0 })).json.request_id;
    paths.sampler = (await resultA(fut.samplerNamed!)).json.path;
    paths.weights = (await resultA(fut.weights!)).json.path;
    paths.external = (await resultA(fut.external!)).json.path;
    samplerA = (await resultA(fut.samplerEph!)).json.sampling_session_id;
    samplerNamedA = ok(await asA('POST', '/create_sampling_session', { session_id: sessA, sampling_session_seq_id: 1, model_path: paths.sampler })).json.sampling_session_id;
    fut.sample = ok(await asA('POST', '/asample', { num_samples: 1, prompt, sampling_params: sp, sampling_session_id: samplerA, seq_id: 0 })).json.request_id;
    expect((await resultA(fut.sample!, PROTO)).status).to.equal(200);
  });
  after(async () => s?.stop());

  it('gives another tenant 404 on every route that names a session, model, sampler, checkpoint or future', async () => {
    const model = /unknown model_id/;
    const session = /unknown session/;
    const ckpt = /does not exist/;
    // Sessions.
    notFound(await asB('POST', '/session_heartbeat', { session_id: sessA }), session);
    notFound(await asB('POST', '/create_model', { session_id: sessA, model_seq_id: 7, base_model: TINY_MODEL_ALIAS, lora_config: { rank: 2 } }), session);
    notFound(await asB('POST', '/create_sampling_session', { session_id: sessA, sampling_session_seq_id: 9, base_model: TINY_MODEL_ALIAS }), session);
    notFound(await asB('POST', '/load_weights', { session_id: sessA, model_seq_id: 8, path: paths.weights, optimizer: true }), session);
    notFound(await asB('GET', `/sessions/${sessA}`), session);
    notFound(await asB('POST', `/sessions/${sessA}/finish`, { reason: { type: 'success' } }), session);
    notFound(await asB('GET', `/sessions/${sessA}/trace_export`), session);
    notFound(await asB('PUT', `/sessions/${sessA}/project`, {}), session);
    notFound(await asB('POST', '/copy_weights', { session_id: sessA, source_path: paths.weights }), ckpt);
    // Models and their seq_id streams.
    notFound(await asB('POST', '/get_info', { model_id: modelA }), model);
    notFound(await call(s.baseUrl, 'POST', '/forward_backward', undefined, { ...B, raw: encodeForwardBackward({ modelId: modelA, seqId: 7, data: batch }) }), model);
    notFound(await asB('POST', '/optim_step', { model_id: modelA, seq_id: 7, adam_params: { ...adam, learning_rate: 1 } }), model);
    notFound(await asB('POST', '/save_weights_for_sampler', { model_id: modelA, seq_id: 7, path: 'evil' }), model);
    notFound(await asB('POST', '/save_weights', { model_id: modelA, seq_id: 7, path: 'evil' }), model);
    notFound(await asB('POST', '/save_weights_external', { model_id: modelA, seq_id: 7, path: 'evil' }), model);
    notFound(await asB('POST', '/load_weights', { model_id: modelA, seq_id: 7, path: paths.weights, optimizer: true }), model);
    notFound(await asB('POST', '/unload_model', { model_id: modelA }), model);
    notFound(await asB('GET', `/training_runs/${encodeURIComponent(modelA)}`), model);
    notFound(await asB('GET', `/training_runs/${encodeURIComponent(modelA)}/checkpoints`), model);
    // Refused requests that would have used up A's seq_ids (a malformed body, an unknown endpoint).
    expect((await asB('POST', '/optim_step', { model_id: modelA, seq_id: 8 })).status).to.equal(400);
    notFound(await asB('POST', '/no_such_op', { model_id: modelA, seq_id: 9 }), /no such endpoint/);
    // Sampling sessions.
    for (const id of [samplerA, samplerNamedA]) {
      notFound(await asB('GET', `/samplers/${encodeURIComponent(id)}`), /unknown sampling_session_id/);
      notFound(await asB('POST', '/join_sampling_session', { sampling_session_id: id }), /unknown sampling_session_id/);
      notFound(await asB('POST', '/asample', { num_samples: 1, prompt, sampling_params: sp, sampling_session_id: id, seq_id: 5 }), /unknown sampling_session_id/);
    }
    // Checkpoints (private).
    for (const p of [paths.sampler, paths.weights, paths.external]) {
      const rest = p.replace('tinker://', '');
      const [, kind, name] = rest.split('/') as [string, string, string];
      const route = `/training_runs/${encodeURIComponent(modelA)}/checkpoints/${kind}/${name}`;
      notFound(await asB('POST', '/weights_info', { tinker_path: p }), ckpt);
      notFound(await asB('DELETE', route), ckpt);
      notFound(await asB('PUT', `${route}/ttl`, { ttl_seconds: 1 }), ckpt);
      notFound(await asB('POST', `${route}/publish`), ckpt);
      notFound(await asB('DELETE', `${route}/publish`), ckpt);
      notFound(await asB('GET', `${route}/external_weights_urls`), ckpt);
      notFound(await asB('POST', '/copy_weights', { source_path: p }), ckpt);
    }
    notFound(await asB('POST', '/create_sampling_session', { session_id: sessB, sampling_session_seq_id: 0, model_path: paths.sampler }), /sampler weights .* does not exist/);
    notFound(await asB('POST', '/asample', { num_samples: 1, prompt, sampling_params: sp, model_path: paths.sampler }), /sampler weights .* does not exist/);
    notFound(await asB('POST', '/load_weights', { session_id: sessB, model_seq_id: 0, path: paths.weights, optimizer: true }), ckpt);
    // Futures.
    for (const id of Object.values(fut)) notFound(await asB('POST', '/retrieve_future', { request_id: id }), /unknown or expired future/);
  });

  it('lists only the caller’s own sessions, runs and checkpoints', async () => {
    expect(ok(await asB('GET', '/sessions')).json.sessions).to.deep.equal([sessB]);
    expect(ok(await asA('GET', '/sessions')).json.sessions).to.deep.equal([sessA]);
    expect(ok(await asB('GET', '/training_runs')).json.training_runs).to.deep.equal([]);
    expect(ok(await asA('GET', '/training_runs')).json.training_runs.map((r: { training_run_id: string }) => r.training_run_id)).to.deep.equal([modelA]);
    expect(ok(await asB('GET', '/checkpoints')).json.checkpoints).to.deep.equal([]);
    expect(ok(await asA('GET', '/checkpoints')).json.checkpoints.map((c: { tinker_path: string }) => c.tinker_path).sort()).to.deep.equal(
      [paths.external, paths.sampler, paths.weights].sort(),
    );
    expect(ok(await asB('POST', '/sessions/search', { user_metadata: { who: 'a' } })).json.sessions).to.deep.equal([]);
    expect(ok(await asA('POST', '/sessions/search', { user_metadata: { who: 'a' } })).json.sessions).to.have.length(1);
    expect(ok(await asB('GET', '/audit')).json.entries).to.deep.equal([]);
    expect(ok(await asA('GET', '/audit')).json.entries).to.have.length(3);
    expect(ok(await asB('GET', '/billing/usage/checkpoints/current')).json.data[0].checkpoint_count).to.equal(0);
  });

  it('leaves the owner’s run untouched: its next seq_ids were not used up, its checkpoints and sessions are intact', async () => {
    // B's refused requests named seq_ids 7, 8 and 9 of A's model; had they been skipped, A's op 7 would be a duplicate of a skip.
    const fb = ok(await call(s.baseUrl, 'POST', '/forward_backward', undefined, { ...A, raw: encodeForwardBackward({ modelId: modelA, seqId: 7, data: batch }) }));
    const out = decodeForwardBackwardOutput((await resultA(fb.json.request_id, PROTO)).body);
    expect(out.logprobs[0]).to.have.length(5);
    expect(ok(await asA('POST', '/optim_step', { model_id: modelA, seq_id: 8, adam_params: adam })).json.request_id).to.be.a('string');
    expect((await resultA(ok(await asA('POST', '/optim_step', { model_id: modelA, seq_id: 9, adam_params: adam })).json.request_id)).json.type).to.equal('optim_step');
    for (const p of [paths.sampler, paths.weights, paths.external]) expect(ok(await asA('POST', '/weights_info', { tinker_path: p })).json.lora_rank).to.equal(2);
    ok(await asA('POST', '/session_heartbeat', { session_id: sessA }));
    expect((await asA('GET', `/training_runs/${encodeURIComponent(modelA)}/checkpoints`)).json.checkpoints).to.have.length(3);
    expect(ok(await asA('GET', `/samplers/${encodeURIComponent(samplerA)}`)).json.sampler_id).to.equal(samplerA);
    for (const id of Object.values(fut)) expect((await asA('POST', '/retrieve_future', { request_id: id })).status).to.equal(200);
  });

  it('lets any tenant read a published checkpoint, and only read it', async () => {
    const route = (p: string) => `/training_runs/${encodeURIComponent(modelA)}/checkpoints/${p.split('/').slice(-2).join('/')}`;
    for (const p of [paths.sampler, paths.weights, paths.external]) ok(await asA('POST', `${route(p)}/publish`));
    // Read: describe, sample, load into B's own model, copy into B's own run, download.
    expect(ok(await asB('POST', '/weights_info', { tinker_path: paths.weights })).json.lora_rank).to.equal(2);
    const ss = ok(await asB('POST', '/create_sampling_session', { session_id: sessB, sampling_session_seq_id: 0, model_path: paths.sampler })).json.sampling_session_id;
    const smp = ok(await asB('POST', '/asample', { num_samples: 1, prompt, sampling_params: sp, sampling_session_id: ss, seq_id: 0 }));
    expect((await call(s.baseUrl, 'POST', '/retrieve_future', { request_id: smp.json.request_id }, A)).status).to.equal(404);
    const loaded = ok(await asB('POST', '/load_weights', { session_id: sessB, model_seq_id: 0, path: paths.weights, optimizer: true }));
    notFound(await asA('POST', '/retrieve_future', { request_id: loaded.json.request_id }), /unknown or expired future/);
    let r: HttpReply;
    do r = await asB('POST', '/retrieve_future', { request_id: loaded.json.request_id });
    while (r.json?.type === 'try_again');
    expect(r.json).to.include({ type: 'load_weights', path: paths.weights });
    const copy = ok(await asB('POST', '/copy_weights', { source_path: paths.weights }));
    expect(copy.json.tinker_path).to.match(/^tinker:\/\/.*:train:0\/weights\/w1$/);
    expect(ok(await asB('GET', '/checkpoints')).json.checkpoints.map((c: { tinker_path: string }) => c.tinker_path)).to.deep.equal([copy.json.tinker_path]);
    expect(Object.keys(ok(await asB('GET', `${route(paths.external)}/external_weights_urls`)).json.urls)).to.include('adapter_config.json');
    // Never write: delete, TTL, unpublish; and A's run itself stays invisible.
    for (const p of [paths.sampler, paths.weights, paths.external]) {
      notFound(await asB('DELETE', route(p)), /does not exist/);
      notFound(await asB('PUT', `${route(p)}/ttl`, { ttl_seconds: 1 }), /does not exist/);
      notFound(await asB('DELETE', `${route(p)}/publish`), /does not exist/);
    }
    notFound(await asB('GET', `/training_runs/${encodeURIComponent(modelA)}`), /unknown model_id/);
    for (const p of [paths.sampler, paths.weights, paths.external]) expect(ok(await asA('POST', '/weights_info', { tinker_path: p })).json.lora_rank).to.equal(2);
    expect(ok(await asA('GET', '/checkpoints')).json.checkpoints.every((c: { public: boolean; expires_at: string | null }) => c.public && c.expires_at === null)).to.equal(true);
  });
});

describe('the default API key', () => {
  it('is refused on a non-loopback interface unless the operator set TB_API_KEYS, with a one-line message', async () => {
    const env: NodeJS.ProcessEnv = { ...process.env, TB_HOST: '0.0.0.0', TB_PORT: '0', TB_PREFIX: 'test-defaultkey', TB_LOG_LEVEL: 'warn' };
    delete env.TB_API_KEYS;
    const r = spawnSync(process.execPath, ['--import', 'tsx', 'api/main.ts'], { env, encoding: 'utf8', timeout: 60_000 });
    expect(r.status).to.equal(2);
    expect(r.stderr.trim().split('\n')).to.deep.equal([
      "refusing to listen on 0.0.0.0 with the well-known default API key 'tml-local': set TB_API_KEYS to your own keys (comma separated), or listen on 127.0.0.1",
    ]);
    expect(() => assertSafeKeys({ host: '0.0.0.0', apiKeys: ['tml-local'] }, { TB_API_KEYS: 'tml-local' })).not.to.throw();
    expect(() => assertSafeKeys({ host: '127.0.0.1', apiKeys: ['tml-local'] }, {})).not.to.throw();
    expect(() => assertSafeKeys({ host: '::1', apiKeys: ['tml-local'] }, {})).not.to.throw();
    expect(() => assertSafeKeys({ host: '10.0.0.5', apiKeys: ['tml-x', 'tml-local'] }, {})).to.throw(StartRefused);
    expect(() => assertSafeKeys({ host: '0.0.0.0', apiKeys: ['tml-mine'] }, {})).not.to.throw();
  });
});
