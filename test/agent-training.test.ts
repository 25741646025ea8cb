import { randomUUID } from 'node:crypto';
import { expect } from 'chai';
import { Redis } from 'ioredis';
import { Names } from '../queues/contract/names.js';
import type { ForwardBackwardJob, ForwardBackwardResult, TrainJob } from '../queues/contract/schemas.js';
import { logger } from '../queues/infra/logger.js';
import { Liveness } from '../queues/runtime/liveness.js';
import { JobRecorder } from '../queues/runtime/metrics.js';
import { Outcomes } from '../queues/runtime/outcomes.js';
import type { TakenTrainJob } from '../queues/runtime/train-consumer.js';
import { Registry } from '../queues/registry/index.js';
import { EngineSupervisor } from '../workers/agent/engine.js';
import { EngineError } from '../workers/engine.js';
import { TrainingPipeline, type TrainingPipelineOptions } from '../workers/agent/training.js';
import { CheckpointJobs } from '../workers/checkpoint-jobs.js';
import { FakeAdapter } from './helpers/fake-adapter.js';
import { deletePrefix, REDIS_URL } from './helpers/stack.js';

/**
 * The agent's ordered training pipeline (workers/agent/training.ts) alone: ops taken from its queue
 * (here handed to it directly) over an adapter without an engine, their outcomes recorded in Redis.
 * The engine runs one op at a time in the order taken; the next op's engine call starts before the
 * previous op's outcome is recorded; an op taken ahead goes back unstarted when the agent drains.
 */
describe('agent training pipeline (unit)', () => {
  const log = logger.child({ test: 'agent-training' });
  const prefix = `test-${randomUUID().slice(0, 8)}`;
  const names = new Names(prefix);
  const agentId = 'a1';
  const lora = { rank: 2, seed: 0, train_unembed: false, train_mlp: true, train_attn: true };
  let redis: Redis;
  let registry: Registry;
  let outcomes: Outcomes;
  let metrics: JobRecorder;

  before(() => {
    redis = new Redis(REDIS_URL);
    registry = new Registry(redis, names);
    outcomes = new Outcomes(redis, names, 60);
    metrics = new JobRecorder(redis, names, () => undefined);
  });
  after(async () => {
    await metrics.flush();
    redis.disconnect();
    await deletePrefix(prefix);
  });

  /** A pipeline over `adapter`; each outcome it records is logged as it is sent (`finish <job id> <state>`) among the adapter's calls. */
  async function pipeline(adapter: FakeAdapter, halted: () => boolean = () => false, cobatchMax = 1, cobatchWaitMs = 0) {
    const engine = new EngineSupervisor({ config: { agentId, models: [], engineRestart: true }, log, adapter, capabilities: { trains: true }, models: registry.models, stopping: () => false, stop: () => undefined });
    await engine.start();
    const recorded: Pick<Outcomes, 'claim' | 'release' | 'finish'> = {
      claim: (...a) => outcomes.claim(...a),
      release: (...a) => outcomes.release(...a),
      finish: (jobId, token, final, ...rest) => {
        adapter.calls.push(`finish ${jobId} ${final.state}`);
        return outcomes.finish(jobId, token, final, ...rest);
      },
    };
    const options: TrainingPipelineOptions = {
      config: { agentId },
      log,
      adapter,
      engine,
      outcomes: recorded,
      liveness: new Liveness(redis, names, registry.models, outcomes),
      registry,
      checkpoints: new CheckpointJobs(registry, adapter, 60),
      metrics,
      queue: names.trainQueue(agentId),
      halted,
      cobatchMax,
      cobatchWaitMs,
    };
    return { p: new TrainingPipeline(options), engine, options };
  }

  const taken = (data: TrainJob, claim: TakenTrainJob['claim'] = null): TakenTrainJob => {
    const id = `j-${randomUUID().slice(0, 8)}`;
    return { id, op: data.op, data, timestamp: Date.now(), claim, token: `inc/${id}`, end: { queuePrefix: '', lockToken: '' } };
  };
  const create = (model: string): TrainJob => ({ op: 'create_model', model_id: model, base_model: '/m/base', lora });
  const fb = (model: string, seq: number): TrainJob => ({ op: 'forward_backward', model_id: model, seq_id: seq, loss_fn: 'cross_entropy', loss_fn_config: {}, forward_only: false, data: [{ tokens: [1, 2], loss_fn_inputs: {} }] });

  it('runs the ops one at a time in the order taken; the next one starts on the engine before the previous outcome is recorded', async () => {
    const adapter = new FakeAdapter('t');
    const { p } = await pipeline(adapter);
    expect(p.claimAtTake(), 'the engine is free: the take claims').to.equal(true);
    const held = adapter.hold('create_model');
    const a = taken(create('m1'));
    const first = p.run(a);
    expect(p.claimAtTake(), 'an op is on the engine: the next one is claimed when its turn comes').to.equal(false);
    const b = taken(fb('m1', 1));
    const second = p.run(b);
    // The second op waits for the engine, however long the first takes.
    await new Promise((r) => setTimeout(r, 20));
    expect(adapter.calls).to.deep.equal(['create_model m1']);
    held.resolve();
    expect(await first).to.deep.equal({ state: 'done' });
    expect(await second).to.deep.equal({ state: 'done' });
    // The first op's outcome is sent once the second op's engine call is under way (the two records then go in either order).
    expect(adapter.calls.slice(0, 2)).to.deep.equal(['create_model m1', 'forward_backward m1']);
    expect(adapter.calls.slice(2)).to.have.members([`finish ${a.id} done`, `finish ${b.id} done`]);
    expect(p.claimAtTake()).to.equal(true);
    expect((await outcomes.get(b.id))!.state).to.equal('done');
  });

  const optim = (model: string, seq: number): TrainJob => ({ op: 'optim_step', model_id: model, seq_id: seq, adam: { learning_rate: 1e-3, beta1: 0.9, beta2: 0.95, eps: 1e-12, weight_decay: 0, grad_clip_norm: 0 } });

  /** An adapter that runs groups; a member of model `failing` fails alone, as the engine answers a member's user error. */
  class Grouping extends FakeAdapter {
    failing = '';
    async forwardBackwardGroup(jobs: ForwardBackwardJob[]): Promise<(ForwardBackwardResult | Error)[]> {
      this.calls.push(`group ${jobs.map((j) => j.model_id).join(',')}`);
      return jobs.map((j) => (j.model_id === this.failing ? new EngineError('user', 'datum 0: a bad datum') : { loss_fn_outputs: [], metrics: { 'loss:sum': 1 } }));
    }
  }
  /** Models placed on this agent (by base model) and loaded on its engine. */
  async function place(engine: EngineSupervisor, models: [string, string][]): Promise<void> {
    for (const [m, base] of models) {
      await registry.models.putIfAbsent({ model_id: m, session_id: 's', base_model: base, arch: 'x', vocab_size: 32, lora, agent_id: agentId, train_queue: 'q', created_at: new Date().toISOString(), lost_reason: null, tenant: '', max_context_length: 64, orphaned_at: null }, 60);
      engine.loaded.add(m);
    }
  }

  it('co-batching: the first waiting forward_backward of each other model on the same base runs in the same engine pass; every model keeps its order', async () => {
    const adapter = new Grouping('t');
    adapter.failing = 'g3';
    const { p, engine } = await pipeline(adapter, () => false, 4);
    await place(engine, [['g1', '/m/base'], ['g2', '/m/base'], ['g3', '/m/base'], ['g4', '/m/base'], ['g5', '/m/other']]);
    const held = adapter.hold('optim_step');
    const running = p.run(taken(optim('g1', 1)));
    // Waiting behind it, in the queue's order.
    const jobs = [fb('g1', 2), fb('g2', 1), fb('g2', 2), fb('g3', 1), fb('g5', 1), optim('g4', 1), fb('g4', 2)].map((d) => taken(d));
    // g3's op was claimed by its take (the consumer does so when the engine is idle): ours, it comes along.
    jobs[3]!.claim = { prev: null };
    expect(await outcomes.claim(jobs[3]!.id, jobs[3]!.op, agentId, jobs[3]!.token)).to.equal(null);
    const verdicts = jobs.map((j) => p.run(j));
    await new Promise((r) => setTimeout(r, 20));
    held.resolve();
    await running;
    expect((await Promise.all(verdicts)).map((v) => v.state)).to.deep.equal(['done', 'done', 'done', 'failed', 'done', 'done', 'done']);
    // g2's second op waits for its first; g5 is on another base; g4's first op is an optim_step.
    expect(adapter.calls.filter((c) => !c.startsWith('finish'))).to.deep.equal(['optim_step g1', 'group g1,g2,g3', 'forward_backward g2', 'forward_backward g5', 'optim_step g4', 'forward_backward g4']);
    expect(await outcomes.get(jobs[1]!.id)).to.include({ state: 'done', cobatch: 3 });
    expect(await outcomes.get(jobs[0]!.id)).to.include({ state: 'done', cobatch: 3 });
    expect(await outcomes.get(jobs[3]!.id)).to.include({ state: 'failed', category: 'user' });
    expect((await outcomes.get(jobs[3]!.id))!.message).to.match(/a bad datum/);
    expect(await outcomes.get(jobs[2]!.id)).to.not.have.property('cobatch');
  });

  it('co-batching gather window: a forward_backward waits for the models training here lately, answering the op before it first, and never past the window', async () => {
    const adapter = new Grouping('t');
    // A window far longer than the test: every pass below ends by its models' arrival, not by time.
    const { p, engine } = await pipeline(adapter, () => false, 4, 60_000);
    await place(engine, [['w1', '/m/base'], ['w2', '/m/base'], ['w3', '/m/base'], ['w4', '/m/base']]);
    // Round 1: all four queued behind a held op; they share a pass and are now the loops training here.
    const held = adapter.hold('optim_step');
    const first = p.run(taken(optim('w4', 1)));
    const round1 = ['w1', 'w2', 'w3', 'w4'].map((m) => p.run(taken(fb(m, 2))));
    await new Promise((r) => setTimeout(r, 20));
    held.resolve();
    await Promise.all([first, ...round1]);
    expect(adapter.calls.filter((c) => c.startsWith('group'))).to.deep.equal(['group w1,w2,w3,w4']);
    // Round 2: w1's optim_step runs, its forward_backward's turn comes with nothing else queued. It waits;
    // meanwhile the optim_step before it is answered (its client's next op may be what it waits for).
    const opt = taken(optim('w1', 3));
    const optRun = p.run(opt);
    const lead = p.run(taken(fb('w1', 4)));
    await optRun;
    while (!adapter.calls.includes(`finish ${opt.id} done`)) await new Promise((r) => setTimeout(r, 5));
    await new Promise((r) => setTimeout(r, 30));
    expect(adapter.calls.filter((c) => c.startsWith('group') || c.startsWith('forward_backward')), 'w1 waits for its partners').to.deep.equal(['group w1,w2,w3,w4']);
    // w2 and w3 queue theirs; w4's next op is an optim_step, which cannot come along: the pass runs without waiting further.
    const late = [p.run(taken(fb('w2', 4))), p.run(taken(fb('w3', 4)))];
    await new Promise((r) => setTimeout(r, 10));
    const w4 = p.run(taken(optim('w4', 3)));
    await Promise.all([lead, ...late, w4]);
    expect(adapter.calls.filter((c) => c.startsWith('group') || c.startsWith('optim_step w4')).slice(-3)).to.deep.equal(['group w1,w2,w3,w4', 'group w1,w2,w3', 'optim_step w4']);
    // Bounded: with a short window, a loop that never sends its op is waited for that long and no longer.
    const shortAdapter = new Grouping('t');
    const short = { adapter: shortAdapter, ...(await pipeline(shortAdapter, () => false, 4, 50)) };
    await place(short.engine, [['w1', '/m/base'], ['w2', '/m/base']]);
    const pair = [short.p.run(taken(fb('w1', 5))), short.p.run(taken(fb('w2', 5)))];
    await Promise.all(pair);
    expect(await short.p.run(taken(fb('w1', 6)))).to.deep.equal({ state: 'done' });
    // w2 missed that window: it is not waited for again until it trains here again (with the window
    // now far longer than the test's time limit, a wait would fail the test).
    short.options.cobatchWaitMs = 600_000;
    expect(await short.p.run(taken(fb('w1', 7)))).to.deep.equal({ state: 'done' });
    expect(short.adapter.calls.filter((c) => !c.startsWith('finish')).slice(-3)).to.deep.equal(['group w1,w2', 'forward_backward w1', 'forward_backward w1']);
  });

  it('fails an op of a model not on this engine with its reason, and the next op still runs', async () => {
    const adapter = new FakeAdapter('t');
    const { p } = await pipeline(adapter);
    const bad = taken(fb('nowhere', 1));
    const v = await p.run(bad);
    expect(v.state).to.equal('failed');
    expect((await outcomes.get(bad.id))!).to.include({ state: 'failed', code: 'UNAVAILABLE' });
    const next = taken(create('m2'));
    expect(await p.run(next)).to.deep.equal({ state: 'done' });
    expect(adapter.calls).to.deep.equal([`finish ${bad.id} failed`, 'create_model m2', `finish ${next.id} done`]);
  });

  it('sends an op taken ahead back to its queue, its claim released, when the agent drains before its turn', async () => {
    let halted = false;
    const adapter = new FakeAdapter('t');
    const { p } = await pipeline(adapter, () => halted);
    const held = adapter.hold('create_model');
    const first = p.run(taken(create('m3')));
    // Taken while the engine was busy, but claimed at take (as the consumer does when it was told to).
    const ahead = taken(fb('m3', 1), { prev: null });
    expect(await outcomes.claim(ahead.id, ahead.op, agentId, ahead.token)).to.equal(null);
    const second = p.run(ahead);
    halted = true;
    expect(p.claimAtTake()).to.equal(false);
    held.resolve();
    expect(await first).to.deep.equal({ state: 'done' });
    expect(await second).to.deep.equal({ state: 'requeue' });
    expect(adapter.calls.filter((c) => c.startsWith('forward_backward'))).to.deep.equal([]);
    expect(await outcomes.get(ahead.id)).to.equal(null);
  });

  it('records OUTCOME_UNKNOWN for an op whose engine died under it', async () => {
    const adapter = new FakeAdapter('t');
    const { p } = await pipeline(adapter);
    expect(await p.run(taken(create('m4')))).to.deep.equal({ state: 'done' });
    const held = adapter.hold('forward_backward');
    const job = taken(fb('m4', 1));
    const run = p.run(job);
    while (!adapter.calls.includes('forward_backward m4')) await new Promise((r) => setTimeout(r, 5));
    adapter.exit('the engine process exited (code null, signal SIGKILL)');
    held.reject(new Error('engine channel closed'));
    expect((await run).state).to.equal('failed');
    const o = (await outcomes.get(job.id))!;
    expect(o).to.include({ state: 'failed', code: 'OUTCOME_UNKNOWN' });
    expect((o as { message: string }).message).to.include('the engine process died while running it');
  });
});
