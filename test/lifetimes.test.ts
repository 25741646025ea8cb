import { expect } from 'chai';
import { randomUUID } from 'node:crypto';
import { Redis } from 'ioredis';
import { Names } from '../queues/contract/names.js';
import type { CheckpointRecord } from '../queues/registry/checkpoints.js';
import { Registry } from '../queues/registry/index.js';
import { pruneListings } from '../queues/registry/listings.js';
import type { ModelRecord } from '../queues/registry/models.js';
import { TINY_MODEL_ALIAS } from '../scripts/stack.js';
import { awaitFuture, call, deletePrefix, REDIS_URL, startStack, type TestStack } from './helpers/stack.js';
import { encodeForwardBackward } from './helpers/wire.js';

/**
 * Redis memory stays bounded under a long run (issue 13): every record has a lifetime (queues/contract/names.ts),
 * restarted while it is in use, and listings drop the entries of records that expired. Real Redis,
 * a key prefix of each test's own.
 */
const sleep = (ms: number) => new Promise((r) => setTimeout(r, ms));

async function keysOf(redis: Redis, prefix: string): Promise<string[]> {
  const out: string[] = [];
  let cursor = '0';
  do {
    const [next, keys] = await redis.scan(cursor, 'MATCH', `${prefix}*`, 'COUNT', 1000);
    cursor = next;
    out.push(...keys);
  } while (cursor !== '0');
  return out.sort();
}

describe('lifetimes: the registry (real Redis)', () => {
  let redis: Redis;
  let names: Names;
  let reg: Registry;
  const tenant = 'ktest';
  const model = (id: string, session: string): ModelRecord => ({
    model_id: id,
    session_id: session,
    base_model: '/m',
    arch: 'qwen3',
    vocab_size: 10,
    lora: { rank: 2, seed: null, train_unembed: true, train_mlp: true, train_attn: true },
    agent_id: 'a',
    train_queue: 'train-a',
    created_at: new Date().toISOString(),
    lost_reason: null,
    tenant,
    max_context_length: 16,
    orphaned_at: null,
  });
  const ckpt = (modelId: string, name: string, ephemeral = false): CheckpointRecord => ({
    tinker_path: `tinker://${modelId}/weights/${name}`,
    model_id: modelId,
    checkpoint_id: `weights/${name}`,
    checkpoint_type: 'training',
    base_model: '/m',
    lora: { rank: 2, seed: null, train_unembed: true, train_mlp: true, train_attn: true },
    dir: `/nowhere/${name}`,
    time: new Date().toISOString(),
    size_bytes: 1,
    expires_at: null,
    public: false,
    has_optimizer: true,
    ephemeral,
    user_metadata: null,
    tenant,
  });

  beforeEach(() => {
    redis = new Redis(REDIS_URL);
    names = new Names(`test-life-${randomUUID().slice(0, 8)}`);
    reg = new Registry(redis, names);
  });
  afterEach(async () => {
    await deletePrefix(names.prefix);
    redis.disconnect();
  });

  it('a session and what it lists live as long as its heartbeats, then leave, and the listing sweep drops their entries', async () => {
    await reg.sessions.create('s1', tenant, {}, 2);
    await reg.models.index(model('s1:train:0', 's1'), 2);
    await reg.models.putIfAbsent(model('s1:train:0', 's1'), 2);
    await reg.samplers.index('s1', 's1:sample:0', 2);
    await reg.samplers.put({ sampling_session_id: 's1:sample:0', session_id: 's1', base_model: '/m', model_path: null, adapter_dir: null, tenant }, 2);
    await reg.sessions.finish('s1', { reason: {} }, 2);
    await reg.models.touch('s1:train:0');
    for (const k of [names.session('s1'), `${names.session('s1')}:models`, `${names.session('s1')}:samplers`, `${names.session('s1')}:finish`, names.model('s1:train:0'), names.samplingSession('s1:sample:0')])
      expect(await redis.ttl(k), k).to.be.within(1, 2);
    // A heartbeat restarts the session's lifetime and its sets'; a sample through the sampling session restarts its own.
    await sleep(1_200);
    expect(await reg.sessions.touch('s1', 2)).to.equal(true);
    await reg.samplers.touch('s1:sample:0', 2);
    await sleep(1_200);
    expect(await reg.sessions.exists('s1')).to.equal(true);
    // The model expired (nothing used it); the sweep drops it from the session's set, the tenant's listing and the last-request times.
    expect(await reg.models.get('s1:train:0')).to.equal(null);
    expect(await reg.sessions.members('s1')).to.deep.equal({ training_run_ids: ['s1:train:0'], sampler_ids: ['s1:sample:0'] });
    expect(await pruneListings(redis, names)).to.equal(2);
    expect(await reg.sessions.members('s1')).to.deep.equal({ training_run_ids: [], sampler_ids: ['s1:sample:0'] });
    expect(await reg.models.list(tenant, 0, 10)).to.deep.equal({ models: [], total: 0 });
    expect(await redis.hexists(names.modelLast(), 's1:train:0')).to.equal(0);
    await sleep(2_200);
    // Everything expired; the sweep empties the tenant's listings (the session, the sampling session), and nothing of the session is left.
    expect(await pruneListings(redis, names)).to.equal(2);
    expect(await reg.sessions.list(tenant, 0, 10)).to.deep.equal([]);
    expect(await keysOf(redis, names.prefix)).to.deep.equal([names.tenants()]);
  });

  it('a model lives on while used, never loses a TTL it was given, and is kept while it has a named checkpoint', async () => {
    const id = 's2:train:0';
    await reg.models.putIfAbsent(model(id, 's2'), 2);
    await redis.set(names.gateNext(id), '1', 'EX', 2);
    // Marking it lost keeps its lifetime (a plain SET would have made it permanent).
    await reg.models.markLost(id, 'gone');
    expect(await redis.ttl(names.model(id))).to.be.within(1, 2);
    expect((await reg.models.markLostOnAgent('a', 'x')).length).to.equal(0);
    // models.keep (an agent's heartbeat) extends, never shortens.
    await reg.models.keep([id], 100);
    expect(await redis.ttl(names.model(id))).to.be.within(99, 100);
    expect(await redis.ttl(names.gateNext(id))).to.be.within(99, 100);
    await reg.models.keep([id], 5);
    expect(await redis.ttl(names.model(id))).to.be.within(99, 100);
    // A named checkpoint keeps the run (and its gate) without a TTL; an unnamed one does not.
    await reg.checkpoints.put(ckpt(id, 'eph', true));
    expect(await redis.ttl(names.model(id))).to.be.above(0);
    await reg.checkpoints.put(ckpt(id, 'w1'));
    await reg.checkpoints.put(ckpt(id, 'w2'));
    expect(await redis.ttl(names.model(id))).to.equal(-1);
    expect(await redis.ttl(names.gateNext(id))).to.equal(-1);
    await reg.models.keep([id], 5);
    expect(await redis.ttl(names.model(id))).to.equal(-1);
    // Deleting one named checkpoint leaves it kept; deleting the last gives it the lifetime back.
    await reg.checkpoints.deleteRecord(ckpt(id, 'w1'), 3);
    expect(await redis.ttl(names.model(id))).to.equal(-1);
    await reg.checkpoints.deleteRecord(ckpt(id, 'eph', true), 3);
    expect(await redis.ttl(names.model(id))).to.equal(-1);
    await reg.checkpoints.deleteRecord(ckpt(id, 'w2'), 3);
    expect(await redis.ttl(names.model(id))).to.be.within(2, 3);
    expect(await redis.ttl(names.gateNext(id))).to.be.within(2, 3);
    expect(await redis.exists(names.modelCheckpoints(id))).to.equal(0);
  });
});

describe('lifetimes: a whole stack under a run of sessions (real agent and engine, retention 4 s)', function () {
  this.timeout(300_000);
  let s: TestStack;
  let redis: Redis;
  const RETENTION_S = 4;
  const adam = { learning_rate: 0.01, beta1: 0.9, beta2: 0.95, eps: 1e-12, weight_decay: 0, grad_clip_norm: 0 };
  const batch = [{ tokens: [5, 17, 42], targets: [17, 42, 99], weights: [1, 1, 1] }];

  before(async () => {
    s = await startStack({
      longPollMs: 2_000,
      env: { TB_FUTURE_RETENTION_S: String(RETENTION_S), TB_RESULT_TTL_AFTER_READ_S: '1', TB_AGENT_TIMEOUT_S: '2' },
    });
    redis = new Redis(REDIS_URL);
  });
  after(async () => {
    redis?.disconnect();
    await s?.stop();
  });

  const done = async (r: { status: number; json: any }) => {
    expect(r.status, JSON.stringify(r.json)).to.equal(200);
    const f = await awaitFuture(s.baseUrl, r.json.request_id);
    expect(f.json?.error, JSON.stringify(f.json)).to.equal(undefined);
    return f.json;
  };
  const createModel = async (session: string) =>
    (await done(await call(s.baseUrl, 'POST', '/create_model', { session_id: session, model_seq_id: 0, base_model: TINY_MODEL_ALIAS, lora_config: { rank: 2, seed: 0 } }))).model_id as string;
  const step = async (model: string, seq: number): Promise<number> => {
    const loss = (await done(await call(s.baseUrl, 'POST', '/forward_backward', undefined, { raw: encodeForwardBackward({ modelId: model, seqId: seq, data: batch }) }))).metrics['loss:sum'];
    await done(await call(s.baseUrl, 'POST', '/optim_step', { model_id: model, seq_id: seq + 1, adam_params: adam }));
    return loss;
  };

  /** One client's whole run: a session, a model trained two steps, an unnamed sampler save sampled from, the model unloaded, the session finished. */
  async function run(): Promise<string> {
    const session = (await call(s.baseUrl, 'POST', '/create_session', { tags: [] })).json.session_id as string;
    const model = await createModel(session);
    await step(model, 1);
    await step(model, 3);
    await call(s.baseUrl, 'POST', '/session_heartbeat', { session_id: session });
    const saved = await done(await call(s.baseUrl, 'POST', '/save_weights_for_sampler', { model_id: model, seq_id: 5, sampling_session_seq_id: 0 }));
    const sample = await done(
      await call(s.baseUrl, 'POST', '/asample', {
        num_samples: 1,
        prompt: { chunks: [{ type: 'encoded_text', tokens: [5, 6, 7] }] },
        sampling_params: { max_tokens: 2, seed: 1 },
        sampling_session_id: saved.sampling_session_id,
        seq_id: 0,
        record_stability_info: false,
      }),
    );
    expect(sample.sequences).to.have.length(1);
    await done(await call(s.baseUrl, 'POST', '/unload_model', { model_id: model }));
    expect((await call(s.baseUrl, 'POST', `/sessions/${session}/finish`, { reason: { type: 'success' } })).status).to.equal(200);
    return session;
  }

  /** Waits until no key of the prefix names any of `sessions` (their records expired, the sweeps ran). */
  async function settled(sessions: string[]): Promise<string[]> {
    const deadline = Date.now() + 60_000;
    for (;;) {
      const keys = await keysOf(redis, s.prefix);
      const left = keys.filter((k) => sessions.some((id) => k.includes(id)));
      if (left.length === 0) return keys;
      if (Date.now() > deadline) throw new Error(`keys still there: ${left.join(', ')}`);
      await sleep(500);
    }
  }

  it("leaves no record of a finished run behind, keeps what is in use, and the key count doesn't grow with the runs", async () => {
    // A model that stays loaded on the live agent, idle far past the retention.
    const keptSession = (await call(s.baseUrl, 'POST', '/create_session', { tags: [] })).json.session_id as string;
    const kept = await createModel(keptSession);
    await step(kept, 1);
    // A run with a named checkpoint is kept as long as the checkpoint, though its weights are gone.
    const namedSession = (await call(s.baseUrl, 'POST', '/create_session', { tags: [] })).json.session_id as string;
    const named = await createModel(namedSession);
    await step(named, 1);
    await done(await call(s.baseUrl, 'POST', '/save_weights', { model_id: named, seq_id: 3, path: 'keep' }));
    await done(await call(s.baseUrl, 'POST', '/unload_model', { model_id: named }));

    // What a finished run leaves only for a while, whatever the number of runs: the per-second token
    // counters (3 min) and the create_model jobs with their owners (kept for the retention after the
    // queue's latest completion: their ids make a retried create idempotent).
    const lasting = (keys: string[]) => keys.filter((k) => !/:metrics:tokens:\w+:\d+$/.test(k) && !/-bull:train-[^:]+:c-[0-9a-f]+$/.test(k) && !/:future-owner:train-[^/]+\/c-[0-9a-f]+$/.test(k));
    const first = [await run(), await run()];
    const afterFirst = lasting(await settled(first));
    const second = [await run(), await run(), await run(), await run()];
    const afterSecond = lasting(await settled(second));
    // Four more runs left exactly the keys two did: nothing of a finished run stays.
    expect(afterSecond, afterSecond.join('\n')).to.deep.equal(afterFirst);
    console.log(`      [lifetimes] keys of the deployment after 2 runs: ${afterFirst.length}, after 4 more: ${afterSecond.length}`);
    const tenant = [...(await redis.smembers(new Names(s.prefix).tenants()))];
    expect(tenant).to.have.length(1);
    const names = new Names(s.prefix);
    const listed = await redis.zrange(names.tenantIndex(tenant[0]!, 'sessions'), 0, -1);
    expect(listed.filter((x) => [...first, ...second].includes(x))).to.deep.equal([]);
    // A model's listing entry and last-request time leave with the listing sweep (every second
    // here), which can come up to a second after its record expired (what `settled` waits for).
    const runs = async () => (await redis.zrange(names.tenantIndex(tenant[0]!, 'models'), 0, -1)).sort();
    const last = async () => Object.keys(await redis.hgetall(names.modelLast())).sort();
    for (let i = 0; i < 30 && ((await runs()).length > 2 || (await last()).length > 2); i++) await sleep(100);
    expect(await runs()).to.deep.equal([kept, named].sort());
    expect(await last()).to.deep.equal([kept, named].sort());

    // The loaded model, idle for many retentions, still trains; the unloaded run with a named checkpoint is still listed.
    expect(await step(kept, 3)).to.be.a('number');
    expect((await call(s.baseUrl, 'GET', `/training_runs/${encodeURIComponent(named)}`)).json.last_checkpoint.checkpoint_id).to.equal('weights/keep');
    expect(await redis.ttl(names.model(named))).to.equal(-1);
    // Its last checkpoint deleted, it expires like any other finished run.
    expect((await call(s.baseUrl, 'DELETE', `/training_runs/${encodeURIComponent(named)}/checkpoints/weights/keep`)).status).to.equal(200);
    await settled([namedSession]);
    expect((await call(s.baseUrl, 'GET', `/training_runs/${encodeURIComponent(named)}`)).status).to.equal(404);
    // The listing sweep (every second here) drops it from the tenant's listing.
    for (let i = 0; i < 50 && (await redis.zcard(names.tenantIndex(tenant[0]!, 'models'))) > 1; i++) await sleep(100);
    expect(await redis.zrange(names.tenantIndex(tenant[0]!, 'models'), 0, -1)).to.deep.equal([kept]);
  });
});
