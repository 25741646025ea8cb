import { randomUUID } from 'node:crypto';
import { existsSync, mkdirSync, mkdtempSync, rmSync } from 'node:fs';
import os from 'node:os';
import path from 'node:path';
import { expect } from 'chai';
import { Redis } from 'ioredis';
import { Names } from '../queues/contract/names.js';
import { logger } from '../queues/infra/logger.js';
import { Outcomes } from '../queues/runtime/outcomes.js';
import { Registry } from '../queues/registry/index.js';
import { ModelRecord } from '../queues/registry/models.js';
import { Adoption } from '../workers/agent/adoption.js';
import { AgentSnapshots, snapshotRoot } from '../workers/snapshots.js';
import { FakeAdapter } from './helpers/fake-adapter.js';
import { Client, expectUnknownOutcome } from './helpers/client.js';
import { enginePid, sleep, spawnAgent, stackEnv, startApi, stopAgent, waitFor, type AgentProc, type Api } from './helpers/procs.js';
import { call, deletePrefix, REDIS_URL, type HttpReply } from './helpers/stack.js';

/**
 * Recovery by placement (issue 32; workers/agent/adoption.ts): an agent dies for good (SIGKILL of
 * the agent and its engine, never restarted) while one op runs in its engine and two more wait
 * behind it. Its model's base is served by no other agent at first: once the reaper has acted, the
 * model waits as an orphan, its waiting ops stay pending, and a new op is admitted. Then a second
 * agent (another id) starts: it adopts the model from its snapshot and runs the waiting ops in
 * order. The op that was running fails with OUTCOME_UNKNOWN and nothing else does; the client's
 * loop goes on with the same model id, on the second agent, with exactly the losses of a twin that
 * was given the same ops without the unknown one. Real processes: the API here, the agents spawned,
 * their engines their children.
 */
describe('adoption: a dead agent\'s model is taken in by another agent from its snapshot', function () {
  this.timeout(600_000);
  let st: ReturnType<typeof stackEnv>;
  let names: Names;
  const redis = new Redis(REDIS_URL);
  let api: Api;
  let agents: AgentProc[] = [];
  const spawn = async (id: string): Promise<AgentProc> => {
    const a = spawnAgent({ ...st.env, TB_AGENT_ID: id, TB_AGENT_TIMEOUT_S: '4' });
    agents.push(a);
    await waitFor(`agent ${id} registered`, async () => {
      if (a.child.exitCode !== null) throw new Error(`agent exited: ${a.log()}`);
      return (await api.built.ctx.registry.agents.live()).some((r) => r.agent_id === id && r.pid === a.child.pid && r.models.length > 0);
    }, 120_000);
    return a;
  };
  const record = async (m: string) => ModelRecord.parse(JSON.parse((await redis.get(names.model(m)))!));
  /** A client, a model of `seed` trained 2 steps, and those steps' losses. */
  const trainedModel = async (seed: number) => {
    const client = new Client(api);
    await client.init();
    const m = await client.createModel(seed);
    return { client, m, before: await client.train(m, 2) };
  };
  /** The agent's engine stopped (SIGSTOP) with a forward_backward of `m` sent to it. */
  const opInStoppedEngine = async (agent: AgentProc, client: Client, m: string) => {
    const engine = await enginePid(agent);
    process.kill(engine, 'SIGSTOP');
    const inFlight = await client.submitFb(m);
    await sleep(300); // taken and sent to the engine
    return { engine, inFlight };
  };

  beforeEach(async () => {
    st = stackEnv(REDIS_URL);
    names = new Names(st.prefix);
    api = await startApi(st.env);
    agents = [];
  });
  afterEach(async function () {
    if (this.currentTest?.state === 'failed') for (const a of agents) console.log(a.log().split('\n').slice(-40).join('\n'));
    for (const a of agents) {
      if (a.child.exitCode === null && a.child.signalCode === null) a.child.kill('SIGCONT');
      await stopAgent(a);
    }
    await api.stop();
    rmSync(st.storage, { recursive: true, force: true });
  });
  after(() => redis.disconnect());

  it('the running op fails with OUTCOME_UNKNOWN, the others wait for an agent of the base, run there, and the loop goes on with the twin\'s losses', async () => {
    const first = await spawn(`a1-${st.prefix}`);
    const { client, m, before } = await trainedModel(3);
    expect((await record(m)).agent_id).to.equal(first.id);

    // One op in the engine (stopped), two behind it; then the node dies with them.
    const { engine, inFlight: running } = await opInStoppedEngine(first, client, m);
    const waitingOptim = await client.submitOptim(m);
    const waitingFb = await client.submitFb(m);
    await stopAgent(first, 'SIGKILL');
    process.kill(engine, 'SIGKILL');

    // Reaped: the model is an orphan, the running op has failed, the others are pending.
    await waitFor('the model orphaned', async () => (await record(m)).orphaned_at !== null, 60_000);
    expect(await redis.zscore(names.orphans(), m)).to.not.equal(null);
    const r1 = await client.result(running, 'application/json', 30_000);
    expectUnknownOutcome(r1, new RegExp(`its worker agent '${first.id}' stopped answering`));
    for (const id of [waitingOptim, waitingFb]) {
      const r = await call(api.baseUrl, 'POST', '/retrieve_future', { request_id: id });
      expect(r.json, JSON.stringify(r.json)).to.include({ type: 'try_again' });
    }
    // An op sent now, while no agent serves the base, is admitted and waits too.
    const later = await client.submitOptim(m);
    await sleep(2_000);
    expect((await call(api.baseUrl, 'POST', '/retrieve_future', { request_id: later })).json).to.include({ type: 'try_again' });
    expect((await record(m)).lost_reason).to.equal(null);

    // An agent serving the base starts (another id): it adopts the model and runs the waiting ops.
    const second = await spawn(`a2-${st.prefix}`);
    const registeredAt = Date.now();
    const [r2, r3, r4] = (await Promise.all([waitingOptim, waitingFb, later].map((id) => client.result(id, 'application/json', 120_000)))) as [HttpReply, HttpReply, HttpReply];
    console.log(`      [adoption] second agent registered -> the 3 pending futures answered ${((Date.now() - registeredAt) / 1000).toFixed(1)} s (heartbeat ${(4 / 5).toFixed(1)} s)`);
    expect(r2.json, JSON.stringify(r2.json)).to.deep.include({ type: 'optim_step' });
    expect(r2.json.metrics.grad_norm, 'the unknown forward_backward left no gradient').to.equal(0);
    expect(r3.json, JSON.stringify(r3.json)).to.have.nested.property('metrics.loss:sum');
    expect(r4.json, JSON.stringify(r4.json)).to.deep.include({ type: 'optim_step' });
    const rec = await record(m);
    expect(rec).to.include({ agent_id: second.id, train_queue: names.trainQueue(second.id), orphaned_at: null, lost_reason: null });
    expect(await redis.zscore(names.orphans(), m)).to.equal(null);
    const after = await client.train(m, 3);

    // A twin given the same ops, without the unknown forward_backward, on the second agent.
    const twin = await client.createModel(3);
    expect(await client.train(twin, 2)).to.deep.equal(before);
    await client.optim(twin);
    const twinFb = (await client.result(await client.submitFb(twin))).json.metrics['loss:sum'];
    expect(r3.json.metrics['loss:sum']).to.equal(twinFb);
    await client.optim(twin);
    expect(await client.train(twin, 3)).to.deep.equal(after);
    expect(after[2]).to.be.below(after[0]!);
  });

  it('an agent reaped while alive (SIGSTOP past its timeout) takes its model back from its snapshot at SIGCONT: only the op in flight fails, the loop goes on with the twin\'s losses', async () => {
    const a = await spawn(`a3-${st.prefix}`);
    const { client, m, before } = await trainedModel(5);
    // An op in the engine when the agent stops, one behind it; the engine finishes the first while
    // the agent is stopped: the agent holds a result the reaper has already given up on.
    const { engine, inFlight } = await opInStoppedEngine(a, client, m);
    const queued = await client.submitOptim(m);
    process.kill(a.child.pid!, 'SIGSTOP');
    process.kill(engine, 'SIGCONT');
    await waitFor('the model orphaned', async () => (await record(m)).orphaned_at !== null, 60_000);
    expectUnknownOutcome(await client.result(inFlight, 'application/json', 30_000), /stopped answering/);
    expect((await call(api.baseUrl, 'POST', '/retrieve_future', { request_id: queued })).json).to.include({ type: 'try_again' });

    // SIGCONT: the agent learns it was reaped before it runs the next op, drops the model (its state
    // holds the op the reaper gave up on) and takes it back from its snapshot.
    process.kill(a.child.pid!, 'SIGCONT');
    const r = await client.result(queued, 'application/json', 120_000);
    expect(r.json, JSON.stringify(r.json)).to.deep.include({ type: 'optim_step' });
    expect(r.json.metrics.grad_norm, 'the forward_backward given up on left no gradient').to.equal(0);
    expect(await record(m)).to.include({ agent_id: a.id, orphaned_at: null, lost_reason: null });
    expect(a.log()).to.match(/this agent was reaped/);
    const after = await client.train(m, 3);

    const twin = await client.createModel(5);
    expect(await client.train(twin, 2)).to.deep.equal(before);
    await client.optim(twin);
    expect(await client.train(twin, 3)).to.deep.equal(after);
  });
});

describe('adoption (unit): an orphan whose record expired', () => {
  const redis = new Redis(REDIS_URL);
  const names = new Names(`adopt-${randomUUID().slice(0, 8)}`);
  const storage = mkdtempSync(path.join(os.tmpdir(), 'tb-adopt-'));
  after(async () => {
    await deletePrefix(names.prefix);
    redis.disconnect();
    rmSync(storage, { recursive: true, force: true });
  });

  it('leaves the orphans, and its snapshots are removed', async () => {
    /** An engine adapter that takes snapshots: the agent's snapshots are on. */
    class Snapshotting extends FakeAdapter {
      async snapshot(): Promise<{ last_error: string | null }> {
        return { last_error: null };
      }
    }
    const adapter = new Snapshotting('toy');
    const registry = new Registry(redis, names);
    const outcomes = new Outcomes(redis, names, 60);
    const log = logger.child({ test: 'adoption' });
    const snapshots = new AgentSnapshots({ policy: { everySteps: 1, everyS: 0, keep: 2 }, storageDir: storage, adapter, redis, names, outcomes, models: registry.models, log });
    const engine = { loaded: new Set<string>(), served: [], ensure: async () => undefined };
    const adoption = new Adoption({ agentId: 'a', queue: names.trainQueue('a'), redis, names, models: registry.models, outcomes, snapshots, engine, adapter, trains: true, halted: () => false, log });
    const gone = 'sess:train:7';
    const dir = path.join(snapshotRoot(storage, gone), '000000000004');
    mkdirSync(dir, { recursive: true });
    await redis.zadd(names.orphans(), Date.now(), gone);
    expect(await adoption.sweep()).to.deep.equal([]);
    expect(await redis.zscore(names.orphans(), gone)).to.equal(null);
    expect(existsSync(snapshotRoot(storage, gone))).to.equal(false);
  });
});
