import { randomUUID } from 'node:crypto';
import { expect } from 'chai';
import { Redis } from 'ioredis';
import { Names } from '../queues/contract/names.js';
import { logger } from '../queues/infra/logger.js';
import { GpuTurns, takingTurns } from '../workers/gpu-turns.js';
import type { EngineAdapter } from '../workers/adapters/adapter.js';
import { deletePrefix, REDIS_URL } from './helpers/stack.js';

/**
 * GPU turns (workers/gpu-turns.ts) between agents of one GPU, on the real Redis, with engines that
 * record what they do: one phase at a time, the hand-over's order (the holder's release before the
 * taker's acquire), no switch when nobody waits, bounded turns, a dead holder's turn ending with its
 * lease, a failed wake-up.
 */

const sleep = (ms: number) => new Promise((r) => setTimeout(r, ms));

describe('GPU turns between agents sharing a GPU', function () {
  this.timeout(60_000);
  const prefix = `test-turns-${randomUUID().slice(0, 8)}`;
  const names = new Names(prefix);
  const conns: Redis[] = [];
  const turns: GpuTurns[] = [];
  let gpu = '';
  /** What happened, in order: `<agent>:acquire`, `<agent>:release`, `<agent>:start`, `<agent>:end`. */
  let events: string[] = [];
  /** Work running now, by agent (never two agents at once). */
  let running = new Map<string, number>();
  let overlaps = 0;

  const agent = (id: string, o: { maxTurnMs?: number; leaseMs?: number; failAcquire?: () => boolean } = {}) => {
    const redis = new Redis(REDIS_URL);
    conns.push(redis);
    const t = new GpuTurns({ names, gpu, agentId: id, log: logger.child({ test: id }), maxTurnMs: o.maxTurnMs ?? 30_000, leaseMs: o.leaseMs ?? 2_000, graceMs: 5, pollMs: 5 });
    t.attach(redis);
    t.setHooks({
      acquire: async () => {
        if (o.failAcquire?.()) throw new Error(`${id} cannot wake up`);
        events.push(`${id}:acquire`);
      },
      release: async () => {
        await sleep(5);
        events.push(`${id}:release`);
      },
    });
    turns.push(t);
    return t;
  };
  /**
   * The events as turns: an agent wakes up only when nobody holds the GPU, releases only what it
   * holds, and works only while it holds the turn.
   */
  const expectTurnOrder = (ev: string[]) => {
    let holder: string | null = null;
    for (const [i, e] of ev.entries()) {
      const [who, what] = e.split(':') as [string, string];
      const at = `event ${i} (${e}) of ${ev.join(' ')}`;
      if (what === 'acquire') {
        expect(holder, at).to.equal(null);
        holder = who;
      } else if (what === 'release') {
        expect(holder, at).to.equal(who);
        holder = null;
      } else if (what === 'start') expect(holder, at).to.equal(who);
    }
  };
  /** One piece of GPU work of `id` lasting `ms`, run inside its turn. */
  const work = (t: GpuTurns, id: string, ms: number) =>
    t.run(async () => {
      if ([...running].some(([who, n]) => who !== id && n > 0)) overlaps++;
      running.set(id, (running.get(id) ?? 0) + 1);
      events.push(`${id}:start`);
      await sleep(ms);
      events.push(`${id}:end`);
      running.set(id, running.get(id)! - 1);
      return id;
    });

  beforeEach(() => {
    gpu = `node-${randomUUID().slice(0, 6)}/0`;
    events = [];
    running = new Map();
    overlaps = 0;
  });
  afterEach(async () => {
    await Promise.all(turns.splice(0).map((t) => t.close()));
  });
  after(async () => {
    for (const c of conns) c.disconnect();
    await deletePrefix(prefix);
  });

  it('runs one agent’s work at a time, the holder’s release before the taker’s wake-up', async () => {
    const a = agent('a');
    const b = agent('b');
    // An RL loop's phases: a burst of samples (the rollout, b), then training ops on them (the trainer, a), three times.
    const done: string[] = [];
    for (let round = 0; round < 3; round++) {
      done.push(...(await Promise.all(Array.from({ length: 4 }, () => work(b, 'b', 15)))));
      done.push(...(await Promise.all([work(a, 'a', 20), work(a, 'a', 10)])));
    }
    expect(done.filter((x) => x === 'a')).to.have.length(6);
    expect(overlaps, events.join(' ')).to.equal(0);
    expectTurnOrder(events);
    // Each phase took the GPU once: b, a, b, a, b, a.
    expect(events.filter((e) => e.endsWith(':acquire'))).to.deep.equal(['b:acquire', 'a:acquire', 'b:acquire', 'a:acquire', 'b:acquire', 'a:acquire']);
    expect(b.stats()).to.include({ taken: 3, given: 3 });
    expect(a.stats()).to.include({ taken: 3, given: 2, holding: true });
  });

  it('keeps the turn while nobody else asks: no release, one wake-up', async () => {
    const a = agent('a');
    agent('b'); // shares the GPU but has no work
    for (let i = 0; i < 10; i++) await work(a, 'a', 2);
    await sleep(50);
    expect(events.filter((e) => e === 'a:acquire')).to.have.length(1);
    expect(events.filter((e) => e.endsWith(':release'))).to.deep.equal([]);
    expect(a.stats()).to.include({ taken: 1, given: 0, holding: true });
  });

  it('bounds a turn: a steady stream of one phase hands over once its turn passed maxTurnMs', async () => {
    const a = agent('a', { maxTurnMs: 100 });
    const b = agent('b', { maxTurnMs: 100 });
    // Two workers of a, each starting its next job as soon as the last ends: a always has work waiting,
    // 80 jobs of 5 ms, far longer than its bounded turn.
    const stream = Promise.all([0, 1].map(async () => {
      for (let n = 0; n < 40; n++) await work(a, 'a', 5);
    }));
    await sleep(20);
    await work(b, 'b', 5);
    await stream;
    expect(overlaps).to.equal(0);
    expectTurnOrder(events);
    const bStart = events.indexOf('b:start');
    // b got the GPU while a still had work: a handed over mid-stream and came back for the rest.
    if (!events.slice(bStart).includes('a:start')) console.log('EVENTS', events.join(' '));
    expect(events.slice(0, bStart)).to.include('a:release');
    expect(events.slice(bStart).filter((e) => e === 'a:start').length).to.be.greaterThan(0);
    expect(events.filter((e) => e === 'a:start')).to.have.length(80);
  });

  it('takes the turn of a holder that died once its lease runs out', async () => {
    const raw = conns[0] ?? new Redis(REDIS_URL);
    if (!conns.includes(raw)) conns.push(raw);
    // A holder that stopped renewing (its process died): the key with a short lease, nobody renewing it.
    await raw.set(names.gpuTurnHolder(gpu), 'dead-agent', 'PX', 300);
    const b = agent('b');
    const r = await work(b, 'b', 1);
    expect(r).to.equal('b');
    expect(await raw.get(names.gpuTurnHolder(gpu))).to.equal('b');
    expect(b.stats().waitMs).to.be.greaterThan(0);
  });

  it('fails the work whose wake-up fails, gives the turn back, and takes it on the next work', async () => {
    let fail = true;
    const a = agent('a', { failAcquire: () => fail });
    let err = '';
    await work(a, 'a', 1).catch((e: Error) => (err = e.message));
    expect(err).to.equal('a cannot wake up');
    expect(await conns[conns.length - 1]!.get(names.gpuTurnHolder(gpu))).to.equal(null);
    fail = false;
    expect(await work(a, 'a', 1)).to.equal('a');
  });

  it('wraps an adapter: training ops and samples take the turn, saving sampler weights does not', async () => {
    const calls: string[] = [];
    const t = agent('a');
    const b = agent('b');
    const inner = {
      kind: 'torch',
      device: 'cuda:0',
      start: async () => undefined,
      stop: async () => undefined,
      loadBase: async () => ({}) as never,
      createModel: async () => ({ model_id: 'm' }),
      forwardBackward: async () => {
        calls.push(`fb holding=${t.stats().holding}`);
        return {} as never;
      },
      optimStep: async () => ({ metrics: {} }),
      saveSampler: async () => {
        calls.push(`save holding=${t.stats().holding}`);
        return { size_bytes: 1 };
      },
      saveState: async () => ({ size_bytes: 1 }),
      loadState: async () => undefined,
      unloadModel: async () => undefined,
      sample: async () => ({}) as never,
      onExit: () => undefined,
      releaseGpu: async () => void calls.push('releaseGpu'),
      reclaimGpu: async () => void calls.push('reclaimGpu'),
    } satisfies EngineAdapter;
    const wrapped = takingTurns(inner, t);
    await wrapped.forwardBackward({} as never);
    // b takes the GPU; a's sampler weights are saved meanwhile, without waiting for the turn.
    await work(b, 'b', 1);
    await wrapped.saveSampler({} as never);
    expect(calls).to.deep.equal(['reclaimGpu', 'fb holding=true', 'releaseGpu', 'save holding=false']);
    expect(wrapped.turns?.()).to.include({ taken: 1, given: 1 });
  });
});
