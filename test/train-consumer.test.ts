import { randomUUID } from 'node:crypto';
import { expect } from 'chai';
import { Job } from 'bullmq';
import { Redis } from 'ioredis';
import { OrderingGate } from '../queues/runtime/gate.js';
import { logger } from '../queues/infra/logger.js';
import { jobIds, Names } from '../queues/contract/names.js';
import { Outcomes } from '../queues/runtime/outcomes.js';
import { QueueSet } from '../queues/runtime/queues.js';
import type { TrainJob } from '../queues/contract/schemas.js';
import { TrainConsumer, type TakenTrainJob, type TrainVerdict } from '../queues/runtime/train-consumer.js';
import { deletePrefix, REDIS_URL } from './helpers/stack.js';

/**
 * The training queue's own consumer (queues/runtime/train-consumer.ts) against real Redis: the jobs the gate
 * writes, taken and claimed by one script, ended by BullMQ's moveToFinished, and read back by
 * BullMQ's Queue and Job as any BullMQ job.
 */
describe('training queue consumer', () => {
  let prefix: string;
  let redis: Redis;
  let names: Names;
  let qs: QueueSet;
  let gate: OrderingGate;
  let outcomes: Outcomes;
  const consumers: TrainConsumer[] = [];
  const modelId = 'sess:train:0';
  const queue = 'train-a';

  const optim = (seq: number): TrainJob => ({
    op: 'optim_step',
    model_id: modelId,
    seq_id: seq,
    adam: { learning_rate: 0.001, beta1: 0.9, beta2: 0.95, eps: 1e-12, weight_decay: 0, grad_clip_norm: 0 },
  });
  const submit = (seq: number) => gate.submit(modelId, seq, queue, jobIds.train(modelId, seq), optim(seq));

  const consumer = (process: (j: TakenTrainJob) => Promise<TrainVerdict>, claimAtTake: () => boolean = () => true, handOff = true) => {
    const c = new TrainConsumer(redis, names, outcomes, queue, { concurrency: 2, lockMs: 30_000, agentId: 'a', tokenPrefix: 'inc/', claimAtTake, process, log: logger, handOff });
    consumers.push(c);
    return c;
  };
  const until = async (what: string, f: () => Promise<boolean> | boolean, ms = 5_000) => {
    const end = Date.now() + ms;
    while (!(await f())) {
      if (Date.now() > end) throw new Error(`timed out waiting for ${what}`);
      await new Promise((r) => setTimeout(r, 10));
    }
  };

  /** A consumer that records the jobs it runs, started, and past seq_id 1 (the first may meet its first look for jobs, which it makes before it blocks). */
  const pastFirstJob = async () => {
    const seen: TakenTrainJob[] = [];
    const c = consumer(async (j) => {
      seen.push(j);
      return { state: 'done' };
    });
    await c.start();
    await submit(1);
    await until('the first job', () => seen.length === 1);
    return { seen, c };
  };

  beforeEach(async () => {
    prefix = `test-${randomUUID().slice(0, 8)}`;
    redis = new Redis(REDIS_URL, { maxRetriesPerRequest: null });
    names = new Names(prefix);
    qs = new QueueSet(redis, names, 3600);
    gate = new OrderingGate(redis, names, qs);
    outcomes = new Outcomes(redis, names, 3600);
    await gate.open(modelId);
  });
  afterEach(async () => {
    for (const c of consumers.splice(0)) await c.close();
    await qs.close();
    redis.disconnect();
    await deletePrefix(prefix);
  });

  it('takes the jobs the gate queues in order, claims an op taken while the engine is free, and ends each as a BullMQ job', async () => {
    const seen: TakenTrainJob[] = [];
    const c = consumer(async (j) => {
      seen.push(j);
      return { state: 'done' };
    });
    await c.start();
    for (const seq of [1, 2, 3]) await submit(seq);
    await until('three jobs', () => seen.length === 3);
    expect(seen.map((j) => (j.data as { seq_id: number }).seq_id)).to.deep.equal([1, 2, 3]);
    expect(seen.every((j) => j.op === 'optim_step' && j.token === `inc/${j.id}`)).to.equal(true);
    // Claimed by the take: the running record a claim writes, before the op ran.
    expect(seen[0]!.claim).to.deep.equal({ prev: null });
    const q = qs.get(queue);
    await until('completed', async () => (await q.getJobCounts('completed')).completed === 3);
    const job = await Job.fromId(q, seen[0]!.id);
    expect(job?.finishedOn).to.be.a('number');
    expect(job?.processedOn).to.be.a('number');
    expect(job?.attemptsStarted).to.equal(1);
    // One consumer: no marker left behind, nothing waiting or active.
    expect(await redis.exists(`${names.bull}:${queue}:marker`)).to.equal(0);
    expect(await q.getJobCounts('waiting', 'active')).to.deep.include({ waiting: 0, active: 0 });
  });

  it("ends a job in the script that records its op done, leaving Redis as BullMQ's moveToFinished leaves it", async () => {
    const q = qs.get(queue);
    const p = `${names.bull}:${queue}:`;
    const seen: TakenTrainJob[] = [];
    const ends: (number | undefined)[] = [];
    const c = consumer(async (j) => {
      const seq = (j.data as { seq_id: number }).seq_id;
      seen.push(j);
      // seq 1 ends through BullMQ (its consumer's moveToCompleted); seq 4 finds its lock another's.
      if (seq === 4) await redis.set(`${p}${j.id}:lock`, 'another');
      if (seq !== 1) await outcomes.finish(j.id, j.token, { state: 'done', op: j.op, agent_id: 'a', result: { metrics: {} } }, true, j.end);
      ends.push(j.end.ended);
      return { state: 'done' };
    });
    await c.start();
    const completed = (n: number) => until(`${n} completed`, async () => (await q.getJobCounts('completed')).completed === n);
    const events = async (id: string) =>
      (await redis.xrange(`${p}events`, '-', '+')).filter(([, f]) => f[f.indexOf('jobId') + 1] === id).map(([, f]) => Object.fromEntries(f.map((v, i) => (i % 2 ? null : [v, f[i + 1]])).filter((e) => e !== null) as [string, string][]));
    const shape = async (id: string) => {
      const h = await redis.hgetall(`${p}${id}`);
      // What differs between two jobs: their payload and the times.
      for (const k of ['data', 'timestamp', 'processedOn', 'finishedOn']) h[k] = typeof h[k];
      return h;
    };
    await submit(1);
    await completed(1);
    await submit(2);
    await completed(2);
    const [one, two] = [seen[0]!.id, seen[1]!.id];
    expect(ends.slice(0, 2)).to.deep.equal([undefined, 1]);
    expect(await shape(two)).to.deep.equal(await shape(one));
    expect((await events(two)).map((e) => ({ ...e, jobId: '' }))).to.deep.equal((await events(one)).map((e) => ({ ...e, jobId: '' })));
    expect((await events(two)).at(-1)).to.deep.equal({ event: 'completed', jobId: two, returnvalue: 'null', prev: 'active' });
    const job = await Job.fromId(q, two);
    expect(await job!.getState()).to.equal('completed');
    expect(job!.returnvalue).to.equal(null);
    expect(job!.attemptsMade).to.equal(1);
    expect(job!.finishedOn).to.be.at.least(job!.processedOn!);
    expect(await redis.exists(`${p}${two}:lock`)).to.equal(0);
    expect(await redis.lrange(`${p}active`, 0, -1)).to.deep.equal([]);
    expect((await redis.xrange(`${p}events`, '-', '+')).filter(([, f]) => f[1] === 'drained')).to.have.length(2);
    // A completed job past its removeOnComplete age leaves at the next end, as BullMQ removes it.
    await redis.zadd(`${p}completed`, Date.now() - 3_601_000, one);
    await submit(3);
    await completed(2);
    expect(ends[2]).to.equal(1);
    expect(await redis.exists(`${p}${one}`)).to.equal(0);
    expect(await redis.zrange(`${p}completed`, 0, -1)).to.have.members([two, seen[2]!.id]);
    // A lock that is another's: the record stands, the job is not ended (it stays active, as after a failed moveToFinished).
    await submit(4);
    await until('the fourth job', () => ends.length === 4);
    expect(ends[3]).to.equal(-6);
    expect((await outcomes.get(seen[3]!.id))?.state).to.equal('done');
    await until('the fourth job let go', async () => (await q.getJobCounts('active', 'completed')).active === 1);
    expect(await redis.lrange(`${p}active`, 0, -1)).to.deep.equal([seen[3]!.id]);
  });

  it('does not claim a job taken ahead, and stores a failure as the BullMQ failed reason', async () => {
    let release!: () => void;
    const held = new Promise<void>((r) => (release = r));
    const seen: TakenTrainJob[] = [];
    let running = 0;
    const c = consumer(
      async (j) => {
        const first = seen.push(j) === 1;
        running++;
        if (first) await held;
        running--;
        return first ? { state: 'done' } : { state: 'failed', reason: '[INVALID_REQUEST] no' };
      },
      () => running === 0,
    );
    await c.start();
    await submit(1);
    await until('the first job', () => seen.length === 1);
    await submit(2);
    await until('the second job', () => seen.length === 2);
    expect(seen[1]!.claim).to.equal(null);
    expect(await outcomes.get(seen[1]!.id)).to.equal(null);
    release();
    const q = qs.get(queue);
    await until('both ended', async () => Object.values(await q.getJobCounts('completed', 'failed')).join() === '1,1');
    expect((await Job.fromId(q, seen[1]!.id))?.failedReason).to.equal('[INVALID_REQUEST] no');
  });

  it("finds another record first when the op's outcome is already final, and never claims over it", async () => {
    await submit(1);
    const id = jobIds.train(modelId, 1);
    await outcomes.failUnknown(id, 'optim_step', 'a', 'reaped');
    const seen: TakenTrainJob[] = [];
    const c = consumer(async (j) => {
      seen.push(j);
      return { state: 'failed', reason: 'x' };
    });
    await c.start();
    await until('the job', () => seen.length === 1);
    expect(seen[0]!.claim?.prev?.state).to.equal('failed');
    expect((await outcomes.get(id))?.token).to.equal('reaper');
  });

  it('puts a requeued job back at the head of its queue, and waits for held jobs when closing', async () => {
    let release!: () => void;
    const held = new Promise<void>((r) => (release = r));
    let n = 0;
    const c = consumer(async () => {
      n++;
      if (n === 1) await held;
      return { state: 'requeue' };
    });
    await c.start();
    await submit(1);
    await until('the job', () => n === 1);
    const closed = c.close();
    release();
    await closed;
    const q = qs.get(queue);
    expect(await q.getJobCounts('waiting', 'active')).to.deep.include({ waiting: 1, active: 0 });
  });

  it("hands a job submitted in its own process to the consumer in the submit's round trip: taken, locked and claimed there", async () => {
    const { seen, c } = await pastFirstJob();
    await submit(2);
    // Handed over before the submit returned: no wake on the marker, no take of the consumer's own.
    expect(seen.map((j) => j.id)).to.deep.equal([jobIds.train(modelId, 1), jobIds.train(modelId, 2)]);
    expect(seen[1]!.data).to.deep.equal(optim(2));
    expect(seen[1]!.claim).to.deep.equal({ prev: null });
    expect((await outcomes.get(seen[1]!.id))?.state).to.equal('running');
    expect(await redis.exists(`${names.bull}:${queue}:marker`)).to.equal(0);
    const q = qs.get(queue);
    await until('completed', async () => (await q.getJobCounts('completed')).completed === 2);
    const job = await Job.fromId(q, seen[1]!.id);
    expect(job?.processedOn).to.be.a('number');
    expect(job?.attemptsStarted).to.equal(1);

    // A consumer that takes no hand-offs takes the job itself, after the submit returned.
    await c.close();
    const mine: TakenTrainJob[] = [];
    const d = consumer(async (j) => {
      mine.push(j);
      return { state: 'done' };
    }, () => true, false);
    await d.start();
    await new Promise((r) => setTimeout(r, 100)); // its first look done: it blocks on the marker
    await submit(3);
    expect(mine.length).to.equal(0);
    await until('the job taken', () => mine.length === 1);
    expect(mine[0]!.data).to.deep.equal(optim(3));
  });

  it('runs jobs in seq_id order when hand-offs and its own takes race (ops submitted out of order, at once)', async () => {
    const seen: number[] = [];
    const c = consumer(async (j) => {
      seen.push((j.data as { seq_id: number }).seq_id);
      await new Promise((r) => setTimeout(r, Math.floor(Math.random() * 3)));
      return { state: 'done' };
    });
    await c.start();
    const n = 60;
    // Bursts of ten seq_ids, each burst sent at once in a shuffled order, the bursts overlapping.
    const bursts: Promise<unknown>[] = [];
    for (let b = 0; b < n / 10; b++) {
      const seqs = Array.from({ length: 10 }, (_, i) => b * 10 + i + 1).sort(() => Math.random() - 0.5);
      bursts.push(Promise.all(seqs.map((q) => submit(q))));
      await new Promise((r) => setTimeout(r, Math.floor(Math.random() * 4)));
    }
    await Promise.all(bursts);
    await until('every job', () => seen.length === n, 15_000);
    expect(seen).to.deep.equal(Array.from({ length: n }, (_, i) => i + 1));
    await until('all completed', async () => (await qs.get(queue).getJobCounts('completed')).completed === n);
  });

  it("runs a job the submit's script took for it when the script's answer was lost, before any later job", async () => {
    const { seen } = await pastFirstJob();
    // The next script runs in Redis (it queues the op and takes it for the consumer), and its answer is lost.
    const evalsha = redis.evalsha.bind(redis);
    let lose = true;
    (redis as unknown as { evalsha: unknown }).evalsha = async (...a: Parameters<typeof evalsha>) => {
      const r = await evalsha(...a);
      if (lose) {
        lose = false;
        throw new Error('Connection is closed.');
      }
      return r;
    };
    try {
      let refused = false;
      await submit(2).catch(() => (refused = true));
      expect(refused).to.equal(true);
    } finally {
      (redis as unknown as { evalsha: unknown }).evalsha = evalsha;
    }
    await until('the job taken without its answer', () => seen.length === 2);
    expect((seen[1]!.data as { seq_id: number }).seq_id).to.equal(2);
    // Claimed by the script's take: this consumer's own running record, so it runs.
    expect(seen[1]!.claim).to.deep.equal({ prev: null });
    await submit(3);
    await until('the third job', () => seen.length === 3);
    expect(seen.map((j) => (j.data as { seq_id: number }).seq_id)).to.deep.equal([1, 2, 3]);
    await until('all completed', async () => (await qs.get(queue).getJobCounts('completed')).completed === 3);
  });
});
