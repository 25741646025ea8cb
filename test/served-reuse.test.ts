import { expect } from 'chai';
import { randomUUID } from 'node:crypto';
import { Redis } from 'ioredis';
import { Names } from '../queues/contract/names.js';
import { RecentReads } from '../queues/infra/recent.js';
import { Registry } from '../queues/registry/index.js';
import { deletePrefix, REDIS_URL } from './helpers/stack.js';

/**
 * Shared and reused reads (queues/infra/recent.ts), and the sample path's use of them: a burst of
 * sample requests shares the agents' read in flight (AgentRegistry.resolveBaseModel's `share`), and
 * a model the shared read lacks is looked up afresh.
 */
describe('RecentReads', () => {
  const counting = () => {
    let n = 0;
    return { read: (v: string) => async () => `${v}${++n}`, count: () => n };
  };

  it('answers from a read younger than the window, in flight or answered, while accept takes it', async () => {
    const r = new RecentReads<string>(60_000);
    const c = counting();
    const [x, y] = await Promise.all([r.get('k', c.read('a')), r.get('k', c.read('a'))]);
    expect([x, y]).to.deep.equal(['a1', 'a1']);
    expect(await r.get('k', c.read('a'))).to.equal('a1');
    // Refused by accept: read afresh, and that read is the one kept.
    expect(await r.get('k', c.read('b'), (v) => v.startsWith('b'))).to.equal('b2');
    expect(await r.get('k', c.read('c'))).to.equal('b2');
    expect(c.count()).to.equal(2);
  });

  it('reads afresh once the answer is older than the window (0: once it came), and keeps no failed read', async () => {
    const r = new RecentReads<string>(10);
    const c = counting();
    expect(await r.get('k', c.read('a'))).to.equal('a1');
    await new Promise((res) => setTimeout(res, 30));
    expect(await r.get('k', c.read('a'))).to.equal('a2');
    const inFlight = new RecentReads<string>(0);
    const [x, y] = await Promise.all([inFlight.get('k', c.read('b')), inFlight.get('k', c.read('b'))]);
    expect([x, y]).to.deep.equal(['b3', 'b3']);
    expect(await inFlight.get('k', c.read('b'))).to.equal('b4');
    const long = new RecentReads<string>(60_000);
    const failed = await long.get('k', async () => Promise.reject(new Error('down'))).catch((e: Error) => e.message);
    expect(failed).to.equal('down');
    expect(await long.get('k', c.read('a'))).to.equal('a5');
  });

  it('keeps at most max keys, the oldest leaving first', async () => {
    const r = new RecentReads<string>(60_000, 2);
    const c = counting();
    await r.get('x', c.read('x'));
    await r.get('y', c.read('y'));
    await r.get('z', c.read('z'));
    expect(await r.get('y', c.read('y'))).to.equal('y2');
    expect(await r.get('x', c.read('x'))).to.equal('x4');
  });
});

describe('served models: the read in flight shared by the sample path', () => {
  const prefix = `test-served-${randomUUID().slice(0, 8)}`;
  const names = new Names(prefix);
  let redis: Redis;
  let registry: Registry;

  const record = (id: string, model: string) =>
    JSON.stringify({
      agent_id: id,
      train_queue: `train-${id}`,
      engine: 'torch',
      device: 'cpu',
      started_at: new Date().toISOString(),
      models: [{ name: model, aliases: [], arch: 'qwen3', vocab_size: 100, max_context_length: 64 }],
    });
  async function addAgent(id: string, model: string): Promise<void> {
    await redis.hset(names.agents(), id, record(id, model));
    await redis.set(names.agentAlive(id), `x ${Date.now()}`, 'EX', 60);
  }
  async function removeAgent(id: string): Promise<void> {
    await redis.hdel(names.agents(), id);
    await redis.del(names.agentAlive(id));
  }

  beforeEach(() => {
    redis = new Redis(REDIS_URL);
    registry = new Registry(redis, names);
  });
  afterEach(async () => {
    await deletePrefix(prefix);
    redis.disconnect();
  });

  it('reads Redis afresh once the shared read has answered', async () => {
    await addAgent('a', '/m/one');
    expect((await registry.agents.resolveBaseModel('/m/one', true)).agents.map((a) => a.agent_id)).to.deep.equal(['a']);
    await removeAgent('a');
    await expectNotServed(registry.agents.resolveBaseModel('/m/one', true));
  });

  it('looks up afresh a model the shared read lacks', async () => {
    await addAgent('a', '/m/one');
    // One connection keeps the order: the first read runs before b registers, the second asks while
    // the first is in flight (so it is shared with it), lacks /m/two there, and reads again after b.
    const first = registry.agents.resolveBaseModel('/m/one', true);
    const added = redis.multi().hset(names.agents(), 'b', record('b', '/m/two')).set(names.agentAlive('b'), `x ${Date.now()}`, 'EX', 60).exec();
    const second = registry.agents.resolveBaseModel('/m/two', true);
    await added;
    expect((await first).agents.map((a) => a.agent_id)).to.deep.equal(['a']);
    expect((await second).agents.map((a) => a.agent_id)).to.deep.equal(['b']);
  });

  it('shares one read among concurrent callers', async () => {
    await addAgent('a', '/m/one');
    // Count the scripts this connection sends (the agents' read is one script, agents-live.lua).
    let scripts = 0;
    const evalsha = redis.evalsha.bind(redis);
    redis.evalsha = ((...args: Parameters<typeof evalsha>) => {
      scripts++;
      return evalsha(...args);
    }) as typeof redis.evalsha;
    const got = await Promise.all(Array.from({ length: 20 }, () => registry.agents.resolveBaseModel('/m/one', true)));
    expect(got.every((g) => g.model.name === '/m/one')).to.equal(true);
    expect(scripts).to.equal(1);
  });
});

async function expectNotServed(p: Promise<unknown>): Promise<void> {
  const err = await p.then(
    () => null,
    (e: Error) => e,
  );
  expect(err?.message).to.match(/base model '\/m\/one' is not served here/);
}
