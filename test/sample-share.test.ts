import { expect } from 'chai';
import { randomUUID } from 'node:crypto';
import { Queue, Worker, type Job } from 'bullmq';
import { Redis } from 'ioredis';
import { Names } from '../queues/contract/names.js';
import { logger } from '../queues/infra/logger.js';
import { parseEntry, SampleShare, SHARE_TIMINGS, shareCap, type ShareTimings } from '../workers/agent/sample-share.js';
import { deletePrefix, REDIS_URL } from './helpers/stack.js';
import { waitFor } from './helpers/procs.js';

/**
 * How agents serving one sample queue share its jobs (workers/agent/sample-share.ts): the share
 * arithmetic, then BullMQ workers on real Redis whose processors hold their jobs until the test lets
 * them go (no engine: what is under test is who takes which job). The whole agents, with their
 * engines, are in test/e2e/sample-share.test.ts.
 */
const { slack } = SHARE_TIMINGS;

describe('sample share: the arithmetic', () => {
  it('gives an agent alone its whole concurrency, whatever the load', () => {
    expect(shareCap({ active: 0, concurrency: 64 }, [], 0, slack)).to.equal(64);
    expect(shareCap({ active: 10, concurrency: 64 }, [], 500, slack)).to.equal(64);
  });

  it('splits the jobs held and waiting by the agents’ concurrencies, plus the slack, at least 1 and at most the concurrency', () => {
    const other = (active: number, concurrency = 64) => ({ active, concurrency });
    // Two idle agents: each may take the slack, so both have room for the first arrivals.
    expect(shareCap({ active: 0, concurrency: 64 }, [other(0)], 0, slack)).to.equal(slack);
    // A burst of 32 seen by either: half each, plus the slack.
    expect(shareCap({ active: 2, concurrency: 64 }, [other(2)], 28, slack)).to.equal(16 + slack);
    // The other agent holds much; this one may take all that waits and its share of the rest.
    expect(shareCap({ active: 0, concurrency: 64 }, [other(30)], 2, slack)).to.equal(16 + slack);
    // An odd total rounds up.
    expect(shareCap({ active: 0, concurrency: 64 }, [other(0)], 33, slack)).to.equal(17 + slack);
    // Weighted: a 48-slot agent beside a 16-slot one takes three quarters.
    expect(shareCap({ active: 0, concurrency: 48 }, [other(0, 16)], 40, 0)).to.equal(30);
    expect(shareCap({ active: 0, concurrency: 16 }, [other(0, 48)], 40, 0)).to.equal(10);
    // Three agents.
    expect(shareCap({ active: 0, concurrency: 64 }, [other(10), other(10)], 10, slack)).to.equal(10 + slack);
    // Bounds.
    expect(shareCap({ active: 0, concurrency: 64 }, [other(0)], 0, 0)).to.equal(1);
    expect(shareCap({ active: 0, concurrency: 4 }, [other(0, 4)], 100, slack)).to.equal(4);
  });

  it('reads a field it wrote, and treats any other text as stale', () => {
    expect(parseEntry(JSON.stringify({ active: 3, concurrency: 64, at: 5 }))).to.deep.equal({ active: 3, concurrency: 64, at: 5 });
    expect(parseEntry('{"active":3}')).to.equal(null);
    expect(parseEntry('not json')).to.equal(null);
  });
});

describe('sample share: BullMQ workers on real Redis', function () {
  this.timeout(60_000);
  const prefix = `test-share-${randomUUID().slice(0, 8)}`;
  const names = new Names(prefix);
  const queueName = `sample-${randomUUID().slice(0, 8)}-torch`;
  const CONCURRENCY = 64;
  let queue: Queue;
  const opened: { close: () => Promise<unknown> }[] = [];
  const conns: Redis[] = [];
  /** Jobs held by each agent's processor, and the functions that let them go. */
  const held = new Map<string, Set<string>>();
  const releases: (() => void)[] = [];

  const conn = () => {
    const r = new Redis(REDIS_URL, { maxRetriesPerRequest: null });
    r.on('error', () => undefined); // the test disconnects one on purpose
    conns.push(r);
    return r;
  };

  /** An agent's sample worker and its share; its processor holds every job until released. */
  async function agent(id: string, timings: Partial<ShareTimings> = {}, redis = conn()): Promise<{ worker: Worker; share: SampleShare; redis: Redis }> {
    held.set(id, new Set());
    let share!: SampleShare;
    const worker = new Worker(
      queueName,
      async (job: Job) => {
        share.started();
        held.get(id)!.add(job.id!);
        try {
          await new Promise<void>((r) => releases.push(r));
        } finally {
          held.get(id)!.delete(job.id!);
          share.ended();
        }
        return { ok: true };
      },
      { connection: redis, prefix: names.bull, name: id, concurrency: CONCURRENCY, maxStalledCount: 0 },
    );
    worker.on('error', () => undefined);
    share = new SampleShare({ redis, key: names.sampleShare(queueName), agentId: id, concurrency: CONCURRENCY, worker, log: logger, timings });
    await worker.waitUntilReady();
    await share.start();
    opened.push(share, { close: () => worker.close(true) });
    return { worker, share, redis };
  }

  const heldBy = (id: string) => held.get(id)!.size;
  const burst = (n: number, tag: string) => queue.addBulk(Array.from({ length: n }, (_, i) => ({ name: 'sample', data: { i }, opts: { jobId: `${tag}-${i}` } })));

  beforeEach(async () => {
    queue = new Queue(queueName, { connection: conn(), prefix: names.bull });
  });

  afterEach(async () => {
    releases.splice(0).forEach((r) => r());
    for (const o of opened.splice(0).reverse()) await o.close().catch(() => undefined);
    await queue.obliterate({ force: true });
    await queue.close();
    for (const c of conns.splice(0)) c.disconnect();
    held.clear();
    await deletePrefix(prefix);
  });

  it('an agent alone takes a whole burst at once, as without sharing', async () => {
    const a = await agent('a');
    await burst(32, 'solo');
    await waitFor('all 32 held by a', async () => heldBy('a') === 32);
    expect(a.worker.concurrency).to.equal(CONCURRENCY);
  });

  it('an agent alone writes its field at its beat only, not at every job start and end', async () => {
    const a = await agent('a', { beatMs: 600_000 });
    const field = async () => parseEntry((await a.redis.hget(names.sampleShare(queueName), 'a')) ?? '');
    expect((await field())?.active).to.equal(0);
    await burst(32, 'quiet');
    await waitFor('all 32 held by a', async () => heldBy('a') === 32);
    releases.splice(0, 8).forEach((r) => r());
    await waitFor('8 ended', async () => heldBy('a') === 24);
    // Its start wrote 0; no job's start or end since has written the field.
    expect((await field())?.active).to.equal(0);
  });

  it('an agent alone ignores and removes a field older than the stale time (by Redis’s clock), or one it cannot read', async () => {
    const r = conn();
    const [sec] = await r.time();
    const key = names.sampleShare(queueName);
    await r.hset(key, 'ghost', JSON.stringify({ active: 30, concurrency: 64, at: Number(sec) * 1000 - SHARE_TIMINGS.staleMs - 1_000 }), 'garbled', 'x');
    const a = await agent('a');
    await waitFor('the unreadable and stale fields removed', async () => JSON.stringify(await r.hkeys(key)) === '["a"]', 5_000, 10);
    await burst(32, 'ghost');
    await waitFor('all 32 held by a', async () => heldBy('a') === 32);
    expect(a.worker.concurrency).to.equal(CONCURRENCY);
  });

  it('two idle agents split a burst of 32 by load, not by race, and BullMQ records who ran each job', async () => {
    const a = await agent('a');
    const b = await agent('b');
    // Each has seen the other (at its next beat at the latest): both wait at the slack.
    await waitFor('both agents capped at the slack', async () => a.worker.concurrency === slack && b.worker.concurrency === slack, 5_000, 20);
    await burst(32, 'pair');
    await waitFor('all 32 held', async () => heldBy('a') + heldBy('b') === 32, 10_000, 10);
    const split = [heldBy('a'), heldBy('b')];
    console.log(`      [sample-share] burst of 32 over two idle agents: ${split.join('/')}`);
    for (const n of split) expect(n).to.be.within(16 - slack, 16 + slack);
    // BullMQ wrote each worker's name (the agent id) on the jobs it took.
    const jobs = await queue.getJobs(['active']);
    const by = (id: string) => jobs.filter((j) => j.processedBy === id).length;
    expect([by('a'), by('b')]).to.deep.equal(split);
  });

  it('when one of two agents dies, the other takes the waiting jobs once its field is stale, though none of its own ended', async () => {
    const a = await agent('a');
    const dying = await agent('b');
    await waitFor('both agents capped at the slack', async () => a.worker.concurrency === slack && dying.worker.concurrency === slack, 5_000, 20);
    await burst(20, 'pre');
    await waitFor('all 20 held', async () => heldBy('a') + heldBy('b') === 20, 10_000, 10);
    const before = heldBy('a');
    // b dies: its connection drops (no more writes, no more fetches); its field stays until stale.
    dying.redis.disconnect();
    await burst(40, 'post');
    // a is at its share of 60 (30 + slack at most) until b's field is stale; then it takes the rest.
    await waitFor('a to hold every post job', async () => heldBy('a') === before + 40, SHARE_TIMINGS.staleMs + 5_000, 20);
    expect(a.worker.concurrency).to.equal(CONCURRENCY);
    // b's field was removed by a's read.
    expect(await a.redis.hkeys(names.sampleShare(queueName))).to.deep.equal(['a']);
  });

  it('an agent that stops removes its field at once: the other takes what waits', async () => {
    // Fields never go stale here: only b's removal lets a take more than its share.
    const a = await agent('a', { staleMs: 600_000 });
    const b = await agent('b', { staleMs: 600_000 });
    await waitFor('both agents capped at the slack', async () => a.worker.concurrency === slack && b.worker.concurrency === slack, 5_000, 20);
    await burst(40, 'x');
    await waitFor('all 40 held', async () => heldBy('a') + heldBy('b') === 40, 10_000, 10);
    const bHeld = heldBy('b');
    // b stops as an agent does: its share first (the field goes), then its worker (no more fetches).
    await b.share.close();
    void b.worker.close();
    expect(await a.redis.hkeys(names.sampleShare(queueName))).to.deep.equal(['a']);
    await burst(30, 'y');
    // BullMQ's close drops b's blocking fetch, but the drop is asynchronous: a fetch already waiting
    // when close began may still wake on this burst and take one job (bullmq 6.7 Worker._getNextJob
    // does not look at `closing` after the wait; CI on a loaded box saw it). b then runs that job
    // before its close ends, so nothing is lost; every other job is a's, above its old share.
    await waitFor('all 30 taken, by a but for one that b’s closing fetch may take', async () => heldBy('a') + heldBy('b') === 70, 10_000, 10);
    expect(heldBy('b') - bHeld).to.be.within(0, 1);
    expect(heldBy('a')).to.be.at.least(40 - bHeld + 29);
    expect(a.worker.concurrency).to.equal(CONCURRENCY);
  });
});
