import { randomUUID } from 'node:crypto';
import { expect } from 'chai';
import { Worker } from 'bullmq';
import { Redis } from 'ioredis';
import { ModelLost, ModelMoved, OrderingGate, type GateOptions } from '../queues/runtime/gate.js';
import { Registry } from '../queues/registry/index.js';
import { jobIds, Names } from '../queues/contract/names.js';
import { QueueSet } from '../queues/runtime/queues.js';
import type { TrainJob } from '../queues/contract/schemas.js';
import { deletePrefix, REDIS_URL } from './helpers/stack.js';

/** The per-model ordering gate against real Redis and real BullMQ queues. */
describe('ordering gate', () => {
  let prefix: string;
  let conns: Redis[];
  let sets: QueueSet[];
  const modelId = 'sess:train:0';
  const queue = 'train-a';

  const optim = (seq: number, lr = seq / 1000): TrainJob => ({
    op: 'optim_step',
    model_id: modelId,
    seq_id: seq,
    adam: { learning_rate: lr, beta1: 0.9, beta2: 0.95, eps: 1e-12, weight_decay: 0, grad_clip_norm: 0 },
  });

  /** One "API process": its own Redis connection, queues and gate. */
  const process = (opts: GateOptions = {}) => {
    const c = new Redis(REDIS_URL, { maxRetriesPerRequest: null });
    conns.push(c);
    const names = new Names(prefix);
    const qs = new QueueSet(c, names, 3600);
    sets.push(qs);
    return { gate: new OrderingGate(c, names, qs, opts), qs, redis: c, names };
  };

  beforeEach(() => {
    prefix = `test-${randomUUID().slice(0, 8)}`;
    conns = [];
    sets = [];
  });
  afterEach(async () => {
    for (const s of sets) await s.close();
    for (const c of conns) c.disconnect();
    await deletePrefix(prefix);
  });

  const refusal = async (p: Promise<unknown>): Promise<string> => {
    try {
      await p;
    } catch (e) {
      return String((e as Error).message);
    }
    return 'not refused';
  };

  async function queuedSeqs(qs: QueueSet): Promise<number[]> {
    // getWaiting lists the wait list oldest first, the order a worker takes them.
    const jobs = await qs.get(queue).getWaiting(0, -1);
    return jobs.map((j) => (j.data as { seq_id: number }).seq_id);
  }

  it('releases ops in seq_id order when requests arrive out of order, across API processes', async () => {
    const a = process();
    const b = process();
    await a.gate.open(modelId);
    const order = [5, 3, 8, 1, 2, 7, 4, 6];
    // Alternate processes and submit all at once, as the SDK's parallel chunks do.
    await Promise.all(order.map((seq, i) => (i % 2 ? a : b).gate.submit(modelId, seq, queue, jobIds.train(modelId, seq), optim(seq))));
    expect(await queuedSeqs(a.qs)).to.deep.equal([1, 2, 3, 4, 5, 6, 7, 8]);
    expect(await a.gate.state(modelId)).to.deep.equal({ next: 9, held: 0 });
    // And a worker of concurrency 1, like an agent's, takes them in that order.
    const ran: number[] = [];
    const c = new Redis(REDIS_URL, { maxRetriesPerRequest: null });
    conns.push(c);
    const done = new Promise<void>((resolve) => {
      const w = new Worker(
        queue,
        async (job) => {
          ran.push((job.data as { seq_id: number }).seq_id);
          if (ran.length === order.length) setImmediate(() => void w.close().then(resolve));
        },
        { connection: c, prefix: new Names(prefix).bull, concurrency: 1 },
      );
    });
    await done;
    expect(ran).to.deep.equal([1, 2, 3, 4, 5, 6, 7, 8]);
  });

  it('holds ops behind a gap and reports them as pending', async () => {
    const { gate, qs } = process();
    await gate.open(modelId);
    await gate.submit(modelId, 2, queue, jobIds.train(modelId, 2), optim(2));
    await gate.submit(modelId, 3, queue, jobIds.train(modelId, 3), optim(3));
    expect(await queuedSeqs(qs)).to.deep.equal([]);
    expect(await gate.heldModel(jobIds.train(modelId, 2))).to.equal(modelId);
    expect(await gate.state(modelId)).to.deep.equal({ next: 1, held: 2 });
    await gate.submit(modelId, 1, queue, jobIds.train(modelId, 1), optim(1));
    expect(await queuedSeqs(qs)).to.deep.equal([1, 2, 3]);
    expect(await gate.heldModel(jobIds.train(modelId, 2))).to.equal(null);
  });

  it('recognises a repeated (model_id, seq_id), held or released, and enqueues it once', async () => {
    const { gate, qs } = process();
    await gate.open(modelId);
    expect(await gate.submit(modelId, 2, queue, jobIds.train(modelId, 2), optim(2))).to.equal('admitted');
    expect(await gate.submit(modelId, 2, queue, jobIds.train(modelId, 2), optim(2))).to.equal('duplicate');
    expect(await gate.submit(modelId, 1, queue, jobIds.train(modelId, 1), optim(1))).to.equal('admitted');
    expect(await gate.submit(modelId, 1, queue, jobIds.train(modelId, 1), optim(1))).to.equal('duplicate');
    expect(await queuedSeqs(qs)).to.deep.equal([1, 2]);
  });

  it('lets later ops run past a skipped seq_id (a request refused at the door)', async () => {
    const { gate, qs } = process();
    await gate.open(modelId);
    await gate.submit(modelId, 3, queue, jobIds.train(modelId, 3), optim(3));
    await gate.submit(modelId, 1, queue, jobIds.train(modelId, 1), optim(1));
    expect(await queuedSeqs(qs)).to.deep.equal([1]);
    await gate.skip(modelId, 2, jobIds.train(modelId, 2));
    expect(await queuedSeqs(qs)).to.deep.equal([1, 3]);
    expect(await gate.state(modelId)).to.deep.equal({ next: 4, held: 0 });
  });

  it('stores a held op once, as its job, and queues only its id when the gap closes', async () => {
    const { gate, qs, redis, names } = process();
    await gate.open(modelId);
    await gate.submit(modelId, 2, queue, jobIds.train(modelId, 2), optim(2));
    // The payload lives in the job alone; the gate holds the job's id.
    expect(await redis.hgetall(names.gateHeld(modelId))).to.deep.equal({ '2': `${queue} ${jobIds.train(modelId, 2)}` });
    const job = await qs.get(queue).getJob(jobIds.train(modelId, 2));
    expect(job!.data).to.deep.equal(optim(2));
    expect(await queuedSeqs(qs)).to.deep.equal([]);
    await gate.submit(modelId, 1, queue, jobIds.train(modelId, 1), optim(1));
    expect(await queuedSeqs(qs)).to.deep.equal([1, 2]);
    expect(await redis.hlen(names.gateHeld(modelId))).to.equal(0);
  });

  it('refuses a job that does not parse before admission, so it never holds later ops back', async () => {
    const { gate, qs } = process();
    await gate.open(modelId);
    const bad = { ...optim(1), adam: { learning_rate: 1e-3, beta1: 2, beta2: 0.95, eps: 1e-12, weight_decay: 0, grad_clip_norm: 0 } } as TrainJob;
    expect(await refusal(gate.submit(modelId, 1, queue, jobIds.train(modelId, 1), bad))).to.match(/invalid optim_step request: adam.beta1/);
    expect(await gate.state(modelId)).to.deep.equal({ next: 1, held: 0 });
    // The route skips the refused seq_id (api/routes/training.ts guardSeq); the next op runs.
    await gate.skip(modelId, 1, jobIds.train(modelId, 1));
    await gate.submit(modelId, 2, queue, jobIds.train(modelId, 2), optim(2));
    expect(await queuedSeqs(qs)).to.deep.equal([2]);
  });

  it("with checkModel, refuses (writing nothing) an op of a model whose record is gone, lost or on another queue, in the submit's one script", async () => {
    const { gate, qs, redis, names } = process();
    await gate.open(modelId);
    const checked = { checkModel: true };
    expect(await refusal(gate.submit(modelId, 1, queue, jobIds.train(modelId, 1), optim(1), checked))).to.match(/has no record/);
    // A record that names another queue: an agent adopted the model since the caller read it.
    await redis.set(names.model(modelId), JSON.stringify({ model_id: modelId, lost_reason: null, train_queue: 'train-adopter' }));
    expect(await gate.submit(modelId, 1, queue, jobIds.train(modelId, 1), optim(1), checked).catch((e) => e)).to.be.instanceOf(ModelMoved);
    expect(await gate.state(modelId)).to.deep.equal({ next: 1, held: 0 });
    await redis.set(names.model(modelId), JSON.stringify({ model_id: modelId, lost_reason: null, train_queue: queue }));
    expect(await gate.submit(modelId, 1, queue, jobIds.train(modelId, 1), optim(1), checked)).to.equal('admitted');
    await redis.set(names.model(modelId), JSON.stringify({ model_id: modelId, lost_reason: 'its engine died' }));
    let lost: unknown;
    await gate.submit(modelId, 2, queue, jobIds.train(modelId, 2), optim(2), checked).catch((e) => (lost = e));
    expect(lost).to.be.instanceOf(ModelLost);
    expect((lost as ModelLost).reason).to.equal('its engine died');
    expect(await queuedSeqs(qs)).to.deep.equal([1]);
    expect(await gate.state(modelId)).to.deep.equal({ next: 2, held: 0 });
    // A refused request's skip is not checked: the seq_id is used up.
    expect(await gate.skip(modelId, 2, jobIds.train(modelId, 2))).to.equal('admitted');
    expect(await gate.state(modelId)).to.deep.equal({ next: 3, held: 0 });
  });

  it('refuses ops for a model whose gate was never opened', async () => {
    const { gate } = process();
    let err: unknown;
    try {
      await gate.submit('nope:train:0', 1, queue, 't-x-1', optim(1));
    } catch (e) {
      err = e;
    }
    expect(String(err)).to.match(/not open/);
  });

  it('refuses seq_ids beyond the window ahead, without holding anything for them', async () => {
    const { gate, redis, names } = process({ window: 16 });
    await gate.open(modelId);
    expect(await refusal(gate.submit(modelId, 17, queue, jobIds.train(modelId, 17), optim(17)))).to.match(/seq_id 17 .* too far ahead: the next op to run is seq_id 1, and at most 16/);
    expect(await refusal(gate.submit(modelId, 4e9, queue, jobIds.train(modelId, 4e9), optim(4e9)))).to.match(/too far ahead/);
    // A refused request far ahead uses up nothing either.
    expect(await gate.skip(modelId, 1000, jobIds.train(modelId, 1000))).to.equal('duplicate');
    expect(await gate.state(modelId)).to.deep.equal({ next: 1, held: 0 });
    expect(await redis.hlen(names.gateHeld(modelId))).to.equal(0);
    expect(await gate.submit(modelId, 16, queue, jobIds.train(modelId, 16), optim(16))).to.equal('admitted');
  });

  it('refuses a replay of a seq_id with a different payload, held or released, and one older than the window', async () => {
    const { gate, qs } = process({ window: 16 });
    await gate.open(modelId);
    await gate.submit(modelId, 2, queue, jobIds.train(modelId, 2), optim(2));
    expect(await refusal(gate.submit(modelId, 2, queue, jobIds.train(modelId, 2), optim(2, 1)))).to.match(/seq_id 2 .* already submitted with a different request/);
    await gate.submit(modelId, 1, queue, jobIds.train(modelId, 1), optim(1));
    expect(await refusal(gate.submit(modelId, 1, queue, jobIds.train(modelId, 1), optim(1, 1)))).to.match(/different request/);
    expect(await gate.submit(modelId, 2, queue, jobIds.train(modelId, 2), optim(2))).to.equal('duplicate');
    // A seq_id used up by a refused request cannot carry an op afterwards.
    await gate.skip(modelId, 3, jobIds.train(modelId, 3));
    expect(await refusal(gate.submit(modelId, 3, queue, jobIds.train(modelId, 3), optim(3)))).to.match(/different request/);
    for (let seq = 4; seq <= 40; seq++) await gate.submit(modelId, seq, queue, jobIds.train(modelId, seq), optim(seq));
    expect(await refusal(gate.submit(modelId, 2, queue, jobIds.train(modelId, 2), optim(2)))).to.match(/seq_id 2 .* more than 16 ops old/);
    expect(await gate.submit(modelId, 30, queue, jobIds.train(modelId, 30), optim(30))).to.equal('duplicate');
    expect(await queuedSeqs(qs)).to.deep.equal([1, 2, ...Array.from({ length: 37 }, (_, i) => i + 4)]);
    // The replay digests stay bounded by the window.
    expect(await conns[0]!.hlen(`${prefix}:gate:${modelId}:digests`)).to.be.at.most(17);
  });

  it('fails the ops held behind a gap at its deadline, with a clear error, and moves on', async () => {
    const { gate, qs, redis, names } = process({ gapTimeoutMs: 400 });
    const registry = new Registry(redis, names);
    await gate.open(modelId);
    await gate.submit(modelId, 1, queue, jobIds.train(modelId, 1), optim(1));
    await gate.submit(modelId, 3, queue, jobIds.train(modelId, 3), optim(3));
    await gate.submit(modelId, 5, queue, jobIds.train(modelId, 5), optim(5));
    const deadline = await gate.gapDeadline(modelId);
    expect(deadline).to.be.a('number');
    expect(await gate.expireGaps()).to.equal(0);
    expect(await gate.state(modelId)).to.deep.equal({ next: 2, held: 2 });
    await new Promise((r) => setTimeout(r, deadline! - Date.now() + 50));
    expect(await gate.expireGaps()).to.equal(1);
    expect(await gate.state(modelId)).to.deep.equal({ next: 6, held: 0 });
    expect(await gate.heldModel(jobIds.train(modelId, 3))).to.equal(null);
    const f3 = await registry.futures.getFailed(jobIds.train(modelId, 3));
    expect(f3).to.include({ op: 'optim_step', category: 'user' });
    expect(f3!.message).to.match(/^not run: seq_id 2, 4 of model sess:train:0 never reached the server within 0.4 s, so this op \(seq_id 3\)/);
    // A late arrival of a missing seq_id finds its failure; the next ops run.
    expect(await gate.submit(modelId, 2, queue, jobIds.train(modelId, 2), optim(2))).to.equal('duplicate');
    expect((await registry.futures.getFailed(jobIds.train(modelId, 2)))!.message).to.match(/did not reach the server within/);
    await gate.submit(modelId, 6, queue, jobIds.train(modelId, 6), optim(6));
    expect(await queuedSeqs(qs)).to.deep.equal([1, 6]);
    expect(await gate.gapDeadline(modelId)).to.equal(null);
  });
});
