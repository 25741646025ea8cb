import { randomUUID } from 'node:crypto';
import { expect } from 'chai';
import { Redis } from 'ioredis';
import { Names } from '../queues/contract/names.js';
import { JobRecorder, readMetrics, recordJob, type JobTiming } from '../queues/runtime/metrics.js';
import { deletePrefix, REDIS_URL } from './helpers/stack.js';

/**
 * An agent's finished jobs go to Redis in one transaction per window (JobRecorder), their counters
 * added up first: Redis then holds what recording each job on its own leaves there.
 */
describe('operation metrics', () => {
  const redis = new Redis(REDIS_URL);
  const prefixes: string[] = [];
  const names = () => {
    const n = new Names(`metrics-${randomUUID().slice(0, 8)}`);
    prefixes.push(n.prefix);
    return n;
  };
  after(async () => {
    for (const p of prefixes) await deletePrefix(p);
    redis.disconnect();
  });

  it('records a window of jobs as one job at a time would, with one command per counter', async () => {
    const t0 = Math.floor(Date.now() / 1000) * 1000;
    const jobs: JobTiming[] = [];
    for (let i = 0; i < 40; i++) {
      const op = ['forward_backward', 'optim_step', 'sample'][i % 3]!;
      const status = i % 7 === 0 ? 'user_error' : i % 11 === 0 ? 'server_error' : 'ok';
      // Latencies that fall in several buckets, and sums that are not whole milliseconds.
      const enqueuedAt = t0 + i * 37;
      const startedAt = enqueuedAt + (i % 5) * 3.25;
      const finishedAt = startedAt + 1 + ((i * 131) % 900) + 0.5;
      const tokens = op === 'sample' ? { kind: 'sampled' as const, n: 10 + i } : op === 'forward_backward' ? { kind: 'trained' as const, n: 64 } : undefined;
      jobs.push({ op, status, enqueuedAt, startedAt, finishedAt, ...(tokens ? { tokens } : {}) });
    }

    const one = names();
    for (const j of jobs) await recordJob(redis, one, j);

    const together = names();
    let sent = 0;
    const counting = new Proxy(redis, {
      get(target, p, receiver) {
        if (p !== 'multi') return Reflect.get(target, p, receiver);
        return () => {
          const m = target.multi();
          const exec = m.exec.bind(m);
          m.exec = (async () => {
            sent += m.length;
            return exec();
          }) as typeof m.exec;
          return m;
        };
      },
    });
    const errors: unknown[] = [];
    const rec = new JobRecorder(counting, together, (e) => errors.push(e), 60_000);
    for (const j of jobs) rec.add(j);
    await rec.flush();
    expect(errors).to.deep.equal([]);

    const a = await readMetrics(redis, one, t0 + 60_000);
    const b = await readMetrics(redis, together, t0 + 60_000);
    expect(b.jobs.sort((x, y) => `${x.op}${x.status}`.localeCompare(`${y.op}${y.status}`))).to.deep.equal(
      a.jobs.sort((x, y) => `${x.op}${x.status}`.localeCompare(`${y.op}${y.status}`)),
    );
    for (const phase of ['queue_wait', 'engine', 'total'] as const) {
      expect([...b.latency[phase].keys()].sort()).to.deep.equal([...a.latency[phase].keys()].sort());
      for (const [op, h] of a.latency[phase]) {
        const g = b.latency[phase].get(op)!;
        expect(g.buckets).to.deep.equal(h.buckets);
        expect(g.count).to.equal(h.count);
        // One sum of the same numbers in another order: equal to the last bits of a double.
        expect(g.sumMs).to.be.closeTo(h.sumMs, 1e-9 * h.sumMs);
      }
    }
    expect(b.tokens).to.deep.equal(a.tokens);
    const secs = async (n: Names) => (await redis.keys(`${n.prefix}:metrics:tokens:*`)).map((k) => k.slice(n.prefix.length)).sort();
    expect(await secs(together)).to.deep.equal(await secs(one));
    // Ten commands a job one at a time; a window sends each counter once (3 ops × 3 statuses × phases' buckets, sums, counts).
    expect(sent).to.be.below(jobs.length * 10 / 2);
  });
});
