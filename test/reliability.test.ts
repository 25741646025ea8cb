import { expect } from 'chai';
import { mkdirSync, rmSync } from 'node:fs';
import path from 'node:path';
import { decodeRequestId } from '../queues/contract/futures.js';
import { Outcomes } from '../queues/runtime/outcomes.js';
import { deletePrefix } from './helpers/stack.js';
import { call } from './helpers/stack.js';
import { Client, expectUnknownOutcome, PROTO } from './helpers/client.js';
import { enginePid, OwnRedis, sleep, spawnAgent, stackEnv, startApi, stopAgent, waitFor, type AgentProc, type Api } from './helpers/procs.js';
import type { TestDatum } from './helpers/wire.js';

/**
 * The worker-side guarantees of docs/reliability.md, with processes killed, stopped and restarted
 * for real: worker agents are `workers/main.ts` processes, Redis is a redis-server of the test's own
 * (AOF on) that is stopped and started again. Figures measured are printed with `[reliability]`.
 */
const figure = (what: string, v: unknown) => console.log(`      [reliability] ${what}: ${typeof v === 'number' ? v.toFixed(2) : String(v)}`);

/** An agent that takes no snapshots: its models are lost when it dies (workers/snapshots.ts). */
const NO_SNAPSHOTS = { TB_SNAPSHOT_EVERY_STEPS: '0' };

describe('reliability: worker agents, outcomes and liveness (real processes, own Redis)', function () {
  this.timeout(300_000);
  const redis = new OwnRedis();
  let st: ReturnType<typeof stackEnv>;
  let api: Api;
  let client: Client;
  const agents: AgentProc[] = [];
  const stopped: number[] = [];

  const agent = async (id: string, extra: Record<string, string> = {}): Promise<AgentProc> => {
    const a = spawnAgent({ ...st.env, TB_AGENT_ID: id, TB_AGENT_TIMEOUT_S: '3', ...extra });
    agents.push(a);
    await waitFor(`agent ${id} registered`, async () => {
      if (a.child.exitCode !== null) throw new Error(`agent exited: ${a.log()}`);
      return (await api.built.ctx.registry.agents.live()).some((r) => r.agent_id === id && r.models.length > 0);
    }, 120_000);
    return a;
  };

  before(async () => {
    await redis.start();
  });
  beforeEach(async () => {
    st = stackEnv(redis.url);
    api = await startApi(st.env);
    client = new Client(api);
    await client.init();
  });
  afterEach(async () => {
    for (const pid of stopped.splice(0)) {
      try {
        process.kill(pid, 'SIGKILL');
      } catch {
        /* gone */
      }
    }
    for (const a of agents.splice(0)) await stopAgent(a);
    await api.stop();
    rmSync(st.storage, { recursive: true, force: true });
  });
  after(async () => {
    await redis.destroy();
  });

  it('a non-finite result fails as a user error naming the datum and changes nothing (issue 13: old logprob -1e38)', async () => {
    await agent(`a-${st.prefix}`);
    const [a, b] = [await client.createModel(3), await client.createModel(3)];
    for (const m of [a, b]) await client.train(m, 1);
    const bad: TestDatum[] = [
      { tokens: [5, 6, 7], targets: [6, 7, 8], logprobs: [-3, -3, -3], advantages: [1, 1, 1] },
      { tokens: [5, 6, 7], targets: [6, 7, 8], logprobs: [-3, -1e38, -3], advantages: [1, 1, 1] },
    ];
    const r = await client.result(await client.submitFb(a, bad, 'importance_sampling'), PROTO);
    expect(r.json.category, JSON.stringify(r.json)).to.equal('user');
    expect(r.json.error).to.match(/datum 1: the loss is -inf .*nothing was applied/);
    // The next optim_step is honest (applied, reported done) and both models go on identically.
    const la = await client.train(a, 3);
    const lb = await client.train(b, 3);
    expect(la).to.deep.equal(lb);
    expect(la.every(Number.isFinite)).to.equal(true);
  });

  it('a Redis outage longer than the job lock does not turn a completed op into a failure, nor run it twice', async () => {
    const a = await agent(`a-${st.prefix}`, { TB_JOB_LOCK_MS: '2000', TB_LOG_LEVEL: 'info' });
    const [m, twin] = [await client.createModel(5), await client.createModel(5)];
    const reference = await client.train(twin, 3);
    // Hold the engine so the op is in flight when Redis goes away, and finishes while it is gone.
    const engine = await enginePid(a);
    process.kill(engine, 'SIGSTOP');
    stopped.push(engine);
    const fb = await client.submitFb(m);
    await waitFor('the op to be taken', () => redisActive(api, a.id));
    const down = Date.now();
    await redis.stop();
    process.kill(engine, 'SIGCONT');
    await sleep(6_000); // three job locks
    await redis.start();
    figure('Redis outage (s), job lock 2 s', (Date.now() - down) / 1000);
    const first = await client.loss(fb);
    await client.optim(m);
    const rest = await client.train(m, 2);
    expect([first, ...rest]).to.deep.equal(reference);
    // The outage is logged once, and its end once, however many connections retried how often.
    expect(a.log().match(/redis unreachable/g), a.log()).to.have.length(1);
    expect(a.log().match(/redis reachable again/g)).to.have.length(1);
    expect(a.log()).to.not.match(/worker error|Unhandled error event/);
  });

  // Without snapshots (TB_SNAPSHOT_EVERY_STEPS=0); with them, test/adoption.test.ts.
  it('a killed agent without snapshots: its running and queued futures fail with OUTCOME_UNKNOWN within the timeout, its models are unavailable, also under a new agent id', async () => {
    const a = await agent(`a-${st.prefix}`, NO_SNAPSHOTS);
    const m = await client.createModel(1);
    await client.train(m, 1);
    const engine = await enginePid(a);
    process.kill(engine, 'SIGSTOP'); // the first op stays in flight
    stopped.push(engine);
    const ids = [await client.submitFb(m), await client.submitOptim(m), await client.submitFb(m)];
    await sleep(300);
    const killedAt = Date.now();
    await stopAgent(a, 'SIGKILL');
    const replies = await Promise.all(ids.map((id) => client.result(id)));
    const took = (Date.now() - killedAt) / 1000;
    figure('agent SIGKILL -> all futures failed (s), timeout 3 s', took);
    for (const r of replies) expectUnknownOutcome(r, /stopped answering \(no heartbeat for over 3 s\)/);
    expect(took).to.be.below(3 + 3 + 2 + 2); // timeout + reaper grace + sweep interval + slack
    const rec = await api.built.ctx.registry.models.get(m);
    expect(rec?.lost_reason).to.match(/stopped answering/);
    // The agent comes back under a new id: the model stays unavailable, said clearly; new models train.
    await agent(`b-${st.prefix}`, NO_SNAPSHOTS);
    const next = await client.result(await client.submitFb(m));
    expect(next.json.error, JSON.stringify(next.json)).to.match(/unavailable: its worker agent .* stopped answering/);
    const fresh = await client.createModel(2);
    expect((await client.train(fresh, 1))[0]).to.be.a('number');
  });

  it('a hung engine (SIGSTOP) is killed at the op time limit: OUTCOME_UNKNOWN, model unavailable, engine restarted', async () => {
    // Without snapshots: the model is lost with the engine (test/recovery.test.ts: with them it comes back).
    const a = await agent(`a-${st.prefix}`, { TB_OP_TIMEOUTS: 'forward_backward=3', TB_SNAPSHOT_EVERY_STEPS: '0' });
    const m = await client.createModel(1);
    await client.train(m, 1);
    const engine = await enginePid(a);
    process.kill(engine, 'SIGSTOP');
    stopped.push(engine);
    const t0 = Date.now();
    const r = await client.result(await client.submitFb(m));
    figure('hung engine -> future failed (s), limit 3 s', (Date.now() - t0) / 1000);
    expectUnknownOutcome(r, /forward_backward ran past its time limit of 3 s/);
    const lost = await waitFor('the model marked lost', async () => (await api.built.ctx.registry.models.get(m))?.lost_reason);
    expect(lost).to.match(/ran past its time limit/);
    const fresh = await client.createModel(2);
    expect((await client.train(fresh, 1))[0]).to.be.a('number');
    expect(await enginePid(a)).to.not.equal(engine);
  });

  // Without snapshots; with them, test/adoption.test.ts.
  it('an agent without snapshots reaped while alive (SIGSTOP past its timeout): futures failed, models unavailable; at SIGCONT it drops them and registers again, an op it finishes late stays failed, new ops work', async () => {
    const id = `a-${st.prefix}`;
    const a = await agent(id, NO_SNAPSHOTS);
    const m = await client.createModel(1);
    await client.train(m, 1);
    // An op in the engine when the agent stops, and one queued behind it; the engine finishes the
    // first while the agent is stopped, so the agent holds a result it has not recorded yet.
    const engine = await enginePid(a);
    process.kill(engine, 'SIGSTOP');
    stopped.push(engine);
    const inFlight = await client.submitFb(m);
    await waitFor('the op to be taken', () => redisActive(api, id));
    const queued = await client.submitOptim(m);
    const stoppedAt = Date.now();
    process.kill(a.child.pid!, 'SIGSTOP');
    process.kill(engine, 'SIGCONT');
    const replies = await Promise.all([inFlight, queued].map((f) => client.result(f)));
    figure('agent SIGSTOP -> its futures failed (s), timeout 3 s', (Date.now() - stoppedAt) / 1000);
    for (const r of replies) expectUnknownOutcome(r, /its worker agent 'a-rel-[0-9a-f]+' stopped answering \(no heartbeat for over 3 s\)/);
    expect((await api.built.ctx.registry.agents.live()).map((r) => r.agent_id)).to.not.include(id);
    // Its model is reported unavailable, at once.
    const refused = await client.result(await client.submitFb(m), 'application/json', 5_000);
    expect(refused.json, JSON.stringify(refused.json)).to.include({ category: 'server', code: 'UNAVAILABLE' });
    expect(refused.json.error).to.match(/^model .* is unavailable: its worker agent 'a-rel-[0-9a-f]+' stopped answering/);
    const ref = decodeRequestId(inFlight)!;
    expect((await api.built.ctx.queues.view(ref.queue, ref.jobId))?.finished).to.equal(false); // the agent has not answered it

    // SIGCONT: the agent learns at its next heartbeat that it was reaped, drops its models and registers again.
    const contAt = Date.now();
    process.kill(a.child.pid!, 'SIGCONT');
    await waitFor('the agent registered again', async () => (await api.built.ctx.registry.agents.live()).some((r) => r.agent_id === id && r.incarnation !== undefined), 30_000);
    figure('SIGCONT -> registered again (s)', (Date.now() - contAt) / 1000);
    await waitFor('the reaped marker cleared', async () => (await api.built.ctx.futures.liveness.reapedWhy(id)) === null, 10_000);
    expect(a.child.exitCode, a.log()).to.equal(null);
    expect(a.log()).to.match(/this agent was reaped \(silent past its timeout\)/);
    // The op it finished after being reaped stays failed: the agent ended its job with the reaper's verdict.
    const job = await waitFor('the late op to end', async () => {
      const v = await api.built.ctx.queues.view(ref.queue, ref.jobId);
      return v?.finished ? v : null;
    }, 30_000);
    expect(job.failedReason).to.match(/OUTCOME_UNKNOWN/);
    const outcome = await new Outcomes(api.built.ctx.redis, api.built.ctx.names, 60).get(ref.jobId);
    expect(outcome).to.include({ state: 'failed', code: 'OUTCOME_UNKNOWN', token: 'reaper' });
    expectUnknownOutcome(await client.result(inFlight), /stopped answering/);
    expectUnknownOutcome(await client.result(queued), /stopped answering/);
    // The reaped model stays unavailable; new models train on the agent, registered again under its id.
    const after = await client.result(await client.submitOptim(m), 'application/json', 5_000);
    expect(after.json.code, JSON.stringify(after.json)).to.equal('UNAVAILABLE');
    const fresh = await client.createModel(2);
    expect((await api.built.ctx.registry.models.get(fresh))?.agent_id).to.equal(id);
    const losses = await client.train(fresh, 2);
    expect(losses.every(Number.isFinite)).to.equal(true);
    expect(await api.built.ctx.futures.liveness.reapedWhy(id)).to.equal(null);
  });

  it('an agent id alive elsewhere cannot be registered again; the first agent keeps it', async () => {
    const id = `a-${st.prefix}`;
    const first = await agent(id);
    const second = spawnAgent({ ...st.env, TB_AGENT_ID: id, TB_AGENT_TIMEOUT_S: '3' });
    agents.push(second);
    expect(await second.exited).to.equal(1);
    expect(second.log()).to.match(/agent id 'a-rel-[0-9a-f]+' is alive elsewhere on this Redis \(prefix 'rel-[0-9a-f]+'\) by .* pid \d+/);
    await sleep(1_500);
    const live = await api.built.ctx.registry.agents.live();
    expect(live.map((r) => r.agent_id)).to.deep.equal([id]);
    expect(live[0]!.pid).to.equal(first.child.pid);
    expect((await client.train(await client.createModel(0), 1))[0]).to.be.a('number');
  });

  it('re-registers after Redis restarts empty, and after a long outage', async () => {
    await agent(`a-${st.prefix}`);
    await redis.stop();
    redis.wipe();
    const t0 = Date.now();
    await redis.start();
    await waitFor('healthz ready again', async () => (await fetch(`${api.baseUrl}/healthz`)).status === 200, 30_000);
    figure('empty Redis restarted -> agent registered again (s)', (Date.now() - t0) / 1000);
    await client.init();
    expect((await client.train(await client.createModel(0), 1))[0]).to.be.a('number');
    // An outage past the liveness timeout: the key expired meanwhile; the agent is not reaped, it re-registers.
    await redis.stop();
    await sleep(5_000);
    await redis.start();
    await waitFor('healthz ready again', async () => (await fetch(`${api.baseUrl}/healthz`)).status === 200, 30_000);
    await sleep(3_000);
    expect(await api.built.ctx.futures.liveness.reapedWhy(`a-${st.prefix}`)).to.equal(null);
  });

  it('drain: SIGTERM finishes the op in flight, saves every model, and the restarted agent continues with the same losses', async () => {
    const id = `a-${st.prefix}`;
    const a = await agent(id);
    const [m, twin] = [await client.createModel(7), await client.createModel(7)];
    const reference = await client.train(twin, 5);
    const before = await client.train(m, 2);
    expect(before).to.deep.equal(reference.slice(0, 2));
    const engine = await enginePid(a);
    process.kill(engine, 'SIGSTOP'); // the op in flight when SIGTERM comes
    stopped.push(engine);
    const inFlight = await client.submitFb(m);
    await waitFor('the op to be taken', () => redisActive(api, id));
    const t0 = Date.now();
    a.child.kill('SIGTERM');
    const queued = await client.submitOptim(m); // queued behind the drain, run by the restarted agent
    await sleep(1_000);
    process.kill(engine, 'SIGCONT');
    expect(await a.exited).to.equal(0);
    figure('drain (op in flight released 1 s after SIGTERM) -> agent exited (s)', (Date.now() - t0) / 1000);
    const drained = JSON.parse((await api.built.ctx.redis.get(`${st.prefix}:agent:${id}:drained`))!);
    expect(drained.models.map((x: { model_id: string }) => x.model_id).sort()).to.deep.equal([m, twin].sort());
    // Ops submitted while the agent is away queue for its restart too (a `docker compose restart` of the agent).
    const [lateFb, lateOptim] = [await client.submitFb(m), await client.submitOptim(m)];
    // Futures stay pending (not failed) while the agent is away, past its liveness timeout.
    await sleep(3_000 + 3_000 + 2_000);
    for (const f of [queued, lateFb, lateOptim]) expect((await call(api.baseUrl, 'POST', '/retrieve_future', { request_id: f })).json.type).to.equal('try_again');
    const t1 = Date.now();
    await agent(id);
    expect(await client.loss(inFlight)).to.equal(reference[2]);
    expect((await client.result(queued)).json.type).to.equal('optim_step');
    figure('restart after drain -> queued op answered (s)', (Date.now() - t1) / 1000);
    expect(await client.loss(lateFb)).to.equal(reference[3]);
    expect((await client.result(lateOptim)).json.type).to.equal('optim_step');
    const after = await client.train(m, 1);
    expect(after).to.deep.equal(reference.slice(4));
  });

  it('a graceful restart of every process (agent drained, API, Redis from its AOF) resumes a training loop with the same losses as an uninterrupted run', async () => {
    const id = `a-${st.prefix}`;
    const a = await agent(id);
    const [m, twin] = [await client.createModel(11), await client.createModel(11)];
    const reference = await client.train(twin, 5);
    expect(await client.train(m, 2)).to.deep.equal(reference.slice(0, 2));
    // An op in the queue when the restart begins: it runs once, after the restart, in its place.
    const t0 = Date.now();
    a.child.kill('SIGTERM');
    const queued = await client.submitFb(m);
    expect(await a.exited).to.equal(0);
    await api.stop();
    await redis.stop('SIGTERM'); // Redis writes its AOF and exits
    await redis.start();
    api = await startApi(st.env);
    Object.assign(client, { api });
    await agent(id);
    figure('graceful restart of agent, API and Redis -> agent serving again (s)', (Date.now() - t0) / 1000);
    expect(await client.loss(queued)).to.equal(reference[2]);
    await client.optim(m);
    expect(await client.train(m, 2)).to.deep.equal(reference.slice(3));
  });

  // Without snapshots: with them, the model waits for an agent to adopt it (test/adoption.test.ts).
  it('an agent without snapshots stopped for good (drain record expired): the next op on its model fails at once saying so, and so does every later one', async () => {
    const id = `a-${st.prefix}`;
    const a = await agent(id, { TB_DRAIN_KEEP_S: '1', ...NO_SNAPSHOTS });
    const m = await client.createModel(3);
    await client.train(m, 1);
    a.child.kill('SIGTERM');
    expect(await a.exited).to.equal(0);
    await waitFor('the drain record to expire', async () => (await api.built.ctx.redis.exists(`${st.prefix}:agent:${id}:drained`)) === 0, 10_000);
    // The first op after the agent is gone is the one that finds out (the gate refuses it): its
    // future fails with the documented error, not a 404 (the seq_id it used up is recorded once).
    for (const submit of [() => client.submitFb(m), () => client.submitOptim(m)]) {
      const r = await client.result(await submit(), 'application/json', 5_000);
      expect(r.json, JSON.stringify(r.json)).to.include({ category: 'server', code: 'UNAVAILABLE' });
      expect(r.json.error).to.equal(`model ${m} is unavailable: its worker agent ${id} is not running; load it from a saved checkpoint`);
    }
  });

  it('tinker-broker drain: drains a running agent, which exits 0 with its models saved', async () => {
    const id = `a-${st.prefix}`;
    const a = await agent(id);
    const m = await client.createModel(1);
    await client.train(m, 1);
    const { spawnSync } = await import('node:child_process');
    const r = spawnSync(process.execPath, ['--import', 'tsx', 'scripts/tinker-broker.ts', 'drain', '--agent', id, '--timeout-s', '60'], { env: { ...process.env, ...st.env }, encoding: 'utf8' });
    expect(r.status, r.stderr).to.equal(0);
    const line = JSON.parse(r.stdout.trim().split('\n').pop()!);
    expect(line).to.include({ agent_id: id, status: 'drained', models_saved: 1 });
    figure('tinker-broker drain -> agent drained (s)', line.seconds);
    expect(await a.exited).to.equal(0);
    const none = spawnSync(process.execPath, ['--import', 'tsx', 'scripts/tinker-broker.ts', 'drain', '--agent', id], { env: { ...process.env, ...st.env }, encoding: 'utf8' });
    expect(none.status).to.equal(1);
    expect(JSON.parse(none.stdout.trim())).to.deep.equal({ agent_id: id, status: 'not_live' });
  });

  it('rebuilds checkpoint records lost from Redis from the files on disk at agent start', async () => {
    const id = `a-${st.prefix}`;
    const a = await agent(id);
    const m = await client.createModel(1);
    await client.train(m, 1);
    const seq = 4; // create 0, fb 1, optim 2 used; the client's counter is at 3
    const w = await call(api.baseUrl, 'POST', '/save_weights', { model_id: m, seq_id: 3, path: 'w1' });
    expect((await client.result(w.json.request_id)).json.path).to.equal(`tinker://${m}/weights/w1`);
    const sw = await call(api.baseUrl, 'POST', '/save_weights_for_sampler', { model_id: m, seq_id: seq, path: 's1' });
    expect((await client.result(sw.json.request_id)).json.path).to.equal(`tinker://${m}/sampler_weights/s1`);
    const list = async () => (await call(api.baseUrl, 'GET', `/training_runs/${m}/checkpoints`)).json.checkpoints.map((c: { checkpoint_id: string }) => c.checkpoint_id).sort();
    expect(await list()).to.deep.equal(['sampler_weights/s1', 'weights/w1']);
    const before = await api.built.ctx.registry.checkpoints.get(`tinker://${m}/weights/w1`);
    // Lose the records (not the files), then restart the agent.
    const r = api.built.ctx.redis;
    const keys = await r.keys(`${st.prefix}:ckpt*`);
    await r.del(...keys, `${st.prefix}:model-ckpts:${m}`);
    expect(await list()).to.deep.equal([]);
    // What an interrupted sampler save leaves: an empty directory under a final name (as saves before
    // the write-then-rename did on a full disk), and a half-written one under its temporary name.
    const samplerDir = path.join(path.dirname(path.dirname(before!.dir)), 'sampler_weights');
    mkdirSync(path.join(samplerDir, 'empty1'));
    mkdirSync(path.join(samplerDir, `s2.tmp-${Date.now()}`));
    a.child.kill('SIGTERM');
    expect(await a.exited).to.equal(0);
    const b = await agent(id);
    expect(await list(), b.log()).to.deep.equal(['sampler_weights/s1', 'weights/w1']);
    const after = await api.built.ctx.registry.checkpoints.get(`tinker://${m}/weights/w1`);
    expect(after).to.deep.include({ checkpoint_type: 'training', has_optimizer: true, dir: before!.dir, size_bytes: before!.size_bytes, tenant: before!.tenant, public: false, expires_at: null });
    expect(await api.built.ctx.registry.checkpoints.get(`tinker://${m}/sampler_weights/empty1`)).to.equal(null);
    expect(b.log()).to.match(/a sampler directory without an adapter \(adapter_config.json\) is left alone/);
  });
});

/** Whether the agent's training queue has an active job (the op was taken). */
async function redisActive(api: Api, agentId: string): Promise<boolean> {
  const q = api.built.ctx.queues.get(`train-${agentId}`);
  return (await q.getActiveCount()) > 0;
}
void deletePrefix;
