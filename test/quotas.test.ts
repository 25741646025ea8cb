import { expect } from 'chai';
import { TINY_MODEL_ALIAS } from '../scripts/stack.js';
import { API_KEY, API_KEY_B, awaitFuture, call, startStack, type HttpReply, type TestStack } from './helpers/stack.js';

/**
 * Tenant quotas (api/quotas.ts): one API key holds at most TB_TENANT_MAX_* sessions, models,
 * sampling sessions and checkpoints. Past a limit the create answers 403 QUOTA_EXCEEDED naming
 * the variable; the other key is not affected; an expired record frees its room; a retried create
 * of a record that exists is not refused; a refused ordered op uses up its seq_id, so the model
 * goes on.
 */
describe('tenant quotas', function () {
  this.timeout(300_000);
  let s: TestStack;
  const A = { key: API_KEY };
  const B = { key: API_KEY_B };
  const asA = (route: string, body?: unknown) => call(s.baseUrl, 'POST', route, body, A);
  const asB = (route: string, body?: unknown) => call(s.baseUrl, 'POST', route, body, B);
  const ok = (r: HttpReply) => {
    expect(r.status, JSON.stringify(r.json)).to.equal(200);
    return r;
  };
  const refused = (r: HttpReply, env: string) => {
    expect(r.status, JSON.stringify(r.json)).to.equal(403);
    expect(r.json).to.include({ category: 'user', code: 'QUOTA_EXCEEDED' });
    expect(r.json.error).to.include(env);
  };

  before(async () => {
    s = await startStack({
      longPollMs: 1_000,
      env: { TB_TENANT_MAX_SESSIONS: '2', TB_TENANT_MAX_MODELS: '1', TB_TENANT_MAX_SAMPLING_SESSIONS: '2', TB_TENANT_MAX_CHECKPOINTS: '2' },
    });
  });
  after(async () => s?.stop());

  it('bounds sessions per API key; an expired session frees its room', async () => {
    const first = ok(await asB('/create_session', { tags: [] })).json.session_id as string;
    ok(await asB('/create_session', { tags: [] }));
    refused(await asB('/create_session', { tags: [] }), 'TB_TENANT_MAX_SESSIONS');
    // The other key has its own room.
    ok(await asA('/create_session', { tags: [] }));
    // A record gone from Redis (expired) no longer counts.
    await s.built.ctx.redis.del(s.built.ctx.names.session(first));
    ok(await asB('/create_session', { tags: [] }));
    refused(await asB('/create_session', { tags: [] }), 'TB_TENANT_MAX_SESSIONS');
  });

  it('bounds models, sampling sessions and checkpoints; retries and overwrites pass, a refused save uses up its seq_id', async () => {
    const sess = ok(await asA('/create_session', { tags: [] })).json.session_id as string;
    const create = { session_id: sess, model_seq_id: 0, base_model: TINY_MODEL_ALIAS, lora_config: { rank: 2, seed: 1 } };
    const cm = ok(await asA('/create_model', create));
    const model = cm.json.model_id as string;
    expect((await awaitFuture(s.baseUrl, cm.json.request_id)).status).to.equal(200);
    // The same create again (a retry) is not a new model.
    ok(await asA('/create_model', create));
    refused(await asA('/create_model', { ...create, model_seq_id: 1 }), 'TB_TENANT_MAX_MODELS');

    for (const seq of [0, 1]) ok(await asA('/create_sampling_session', { session_id: sess, sampling_session_seq_id: seq, base_model: TINY_MODEL_ALIAS }));
    ok(await asA('/create_sampling_session', { session_id: sess, sampling_session_seq_id: 1, base_model: TINY_MODEL_ALIAS }));
    refused(await asA('/create_sampling_session', { session_id: sess, sampling_session_seq_id: 2, base_model: TINY_MODEL_ALIAS }), 'TB_TENANT_MAX_SAMPLING_SESSIONS');
    // An unnamed sampler save makes a sampling session: refused too.
    refused(await asA('/save_weights_for_sampler', { model_id: model, seq_id: 1, sampling_session_seq_id: 5 }), 'TB_TENANT_MAX_SAMPLING_SESSIONS');

    let seq = 2;
    for (const path of ['w1', 'w2']) {
      const r = ok(await asA('/save_weights', { model_id: model, seq_id: seq++, path }));
      expect((await awaitFuture(s.baseUrl, r.json.request_id)).status).to.equal(200);
    }
    refused(await asA('/save_weights', { model_id: model, seq_id: seq++, path: 'w3' }), 'TB_TENANT_MAX_CHECKPOINTS');
    refused(await asA('/save_weights_for_sampler', { model_id: model, seq_id: seq++, path: 's1' }), 'TB_TENANT_MAX_CHECKPOINTS');
    // Saving over a checkpoint it holds adds nothing; the refused seq_ids were used up, so this one runs at once.
    const over = ok(await asA('/save_weights', { model_id: model, seq_id: seq++, path: 'w1', overwrite: true }));
    expect((await awaitFuture(s.baseUrl, over.json.request_id)).status).to.equal(200);
    // Deleting a checkpoint frees its room.
    const del = await call(s.baseUrl, 'DELETE', `/training_runs/${model}/checkpoints/weights/w2`, undefined, A);
    expect(del.status, JSON.stringify(del.json)).to.be.oneOf([200, 204]);
    const again = ok(await asA('/save_weights', { model_id: model, seq_id: seq++, path: 'w3' }));
    expect((await awaitFuture(s.baseUrl, again.json.request_id)).status).to.equal(200);
  });
});
