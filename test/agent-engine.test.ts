import { randomUUID } from 'node:crypto';
import { expect } from 'chai';
import { Redis } from 'ioredis';
import { Names } from '../queues/contract/names.js';
import { BrokerError } from '../queues/contract/errors.js';
import { logger } from '../queues/infra/logger.js';
import { Registry } from '../queues/registry/index.js';
import type { BaseModelSpec } from '../queues/infra/config.js';
import { EngineSupervisor, OpTimeout, RESTART_TRIES } from '../workers/agent/engine.js';
import { FakeAdapter } from './helpers/fake-adapter.js';
import { deletePrefix, REDIS_URL } from './helpers/stack.js';

/**
 * The agent's engine supervisor (workers/agent/engine.ts) alone, over an adapter without an engine
 * and the models' records in Redis: op time limits kill the engine, a dead engine loses its models
 * (with the reason) and is restarted, or stops the agent when restarts are off.
 */
describe('agent engine supervision (unit)', () => {
  const log = logger.child({ test: 'agent-engine' });
  const prefix = `test-${randomUUID().slice(0, 8)}`;
  const names = new Names(prefix);
  const agentId = 'a1';
  const spec: BaseModelSpec = { name: '/m/base', path: '/m/base', aliases: ['base'], trainable: true, loraMaxRank: 8, topkMax: 5 };
  let redis: Redis;
  let registry: Registry;
  let stops: number;

  before(() => {
    redis = new Redis(REDIS_URL);
    registry = new Registry(redis, names);
  });
  after(async () => {
    redis.disconnect();
    await deletePrefix(prefix);
  });
  beforeEach(() => {
    stops = 0;
  });

  function supervisor(adapter: FakeAdapter, o: { engineRestart?: boolean; opTimeoutsS?: Record<string, number>; trains?: boolean; stopping?: () => boolean } = {}): EngineSupervisor {
    return new EngineSupervisor({
      config: { agentId, models: [spec], engineRestart: o.engineRestart ?? true, opTimeoutsS: o.opTimeoutsS },
      log,
      adapter,
      capabilities: { trains: o.trains ?? true },
      models: registry.models,
      stopping: o.stopping ?? (() => false),
      stop: () => stops++,
    });
  }

  async function placeModel(modelId: string): Promise<void> {
    const lora = { rank: 2, seed: 0, train_unembed: false, train_mlp: true, train_attn: true };
    await registry.models.putIfAbsent(
      { model_id: modelId, session_id: 's', base_model: spec.name, arch: 'x', vocab_size: 32, lora, agent_id: agentId, train_queue: 'q', created_at: new Date().toISOString(), lost_reason: null, tenant: '', max_context_length: 64, orphaned_at: null },
      60,
    );
  }

  it('starts the engine and loads the base models; an engine that does not train serves them frozen', async () => {
    const trains = supervisor(new FakeAdapter('t'));
    await trains.start();
    expect(trains.served.map((m) => [m.name, m.trainable])).to.deep.equal([[spec.name, true]]);
    const frozen = supervisor(new FakeAdapter('t'), { trains: false });
    await frozen.start();
    expect(frozen.served[0]!.trainable).to.equal(false);
  });

  it('answers an op within its limit and keeps the engine', async () => {
    const adapter = new FakeAdapter('t');
    const s = supervisor(adapter, { opTimeoutsS: { optim_step: 5 } });
    await s.start();
    expect(await s.timed('optim_step', Promise.resolve(7))).to.equal(7);
    expect(adapter.kills).to.equal(0);
    expect(s.epoch).to.equal(0);
  });

  it('kills the engine of an op past its limit; the models are lost with that reason, and the engine restarts', async () => {
    const adapter = new FakeAdapter('t');
    const s = supervisor(adapter, { opTimeoutsS: { forward_backward: 0.05 } });
    await s.start();
    await placeModel('m-hung');
    s.loaded.add('m-hung');
    const hung = new Promise<never>(() => undefined);
    const err = await s.timed('forward_backward', hung).then(
      () => null,
      (e: Error) => e,
    );
    expect(err).to.be.instanceOf(OpTimeout);
    expect(err!.message).to.equal('forward_backward ran past its time limit of 0.05 s (TB_OP_TIMEOUTS); the agent killed its engine as hung');
    expect(adapter.kills).to.equal(1);
    // The kill's exit: a new epoch, the models gone from this engine, a restart under way that ops wait for.
    expect(s.epoch).to.equal(1);
    expect([...s.loaded]).to.deep.equal([]);
    expect(s.restarting).to.not.equal(null);
    await s.ensure();
    expect(s.restarting).to.equal(null);
    expect(adapter.starts).to.equal(2);
    expect((await registry.models.get('m-hung'))!.lost_reason).to.equal(`${err!.message}; load it from a saved checkpoint`);
    // The next op's model says why it is unavailable.
    const unavailable = await s.requireLoaded('m-hung').then(
      () => null,
      (e: BrokerError) => e,
    );
    expect(unavailable).to.be.instanceOf(BrokerError);
    expect(unavailable!.code).to.equal('UNAVAILABLE');
    expect(unavailable!.message).to.include('ran past its time limit');
    expect(stops).to.equal(0);
  });

  it('starts the engine again when the new one dies as it starts, and stops the agent after RESTART_TRIES failed starts', async () => {
    const adapter = new FakeAdapter('t');
    const s = supervisor(adapter);
    s.restartBackoffMs = 1;
    await s.start();
    adapter.dyingStarts = RESTART_TRIES - 1;
    adapter.exit('the engine process exited (code null, signal SIGKILL)');
    await s.ensure();
    expect(adapter.starts).to.equal(1 + RESTART_TRIES);
    expect(stops).to.equal(0);
    expect(s.restarting).to.equal(null);

    const exitCode = process.exitCode;
    try {
      adapter.dyingStarts = RESTART_TRIES;
      adapter.exit('the engine process exited (code null, signal SIGKILL)');
      await s.ensure();
      expect(adapter.starts).to.equal(1 + 2 * RESTART_TRIES);
      expect(stops).to.equal(1);
      expect(process.exitCode).to.equal(1);
    } finally {
      process.exitCode = exitCode;
    }
  });

  it('stops the agent when its engine dies and restarts are off; ignores an exit while the agent stops', async () => {
    const adapter = new FakeAdapter('t');
    const s = supervisor(adapter, { engineRestart: false });
    await s.start();
    const exitCode = process.exitCode;
    try {
      adapter.exit('the engine process exited (code 1, signal null)');
      await s.ensure();
      expect(stops).to.equal(1);
      expect(process.exitCode).to.equal(1);
    } finally {
      process.exitCode = exitCode;
    }
    expect(adapter.starts).to.equal(1);

    const quietAdapter = new FakeAdapter('t');
    const q = supervisor(quietAdapter, { stopping: () => true });
    await q.start();
    quietAdapter.exit('stopped');
    expect(q.epoch).to.equal(0);
    expect(q.restarting).to.equal(null);
  });
});
