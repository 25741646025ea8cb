import { spawnSync } from 'node:child_process';
import { expect } from 'chai';
import { Redis } from 'ioredis';
import { decodeRequestId } from '../../queues/contract/futures.js';
import { Names } from '../../queues/contract/names.js';
import { Outcomes } from '../../queues/runtime/outcomes.js';
import { Client, expectUnknownOutcome } from '../helpers/client.js';
import { waitFor } from '../helpers/procs.js';
import { API_KEY, REDIS_URL } from '../helpers/stack.js';
import { E2EServer } from './server.js';

/**
 * A node crash (issue 32's first defect): the start command's process, API and agent together, and
 * its engine are killed with SIGKILL while an op runs in the engine and two more are queued
 * behind it (taken ahead by the agent, or waiting), then started again with the same command, prefix and agent id, as a restart policy does.
 * Every future resolves and nothing stays on the queue: the op that was running fails with
 * OUTCOME_UNKNOWN (nobody knows whether it was applied). With snapshots (the default) the restarted
 * agent brings the model back from its snapshot, the ops that never started run on it, and the
 * model is exactly a twin's that never ran the unknown op. Without snapshots they fail saying the
 * model was lost. Either way the node trains again.
 */
for (const snapshots of [true, false]) {
  describe(`a node crash: kill -9 of the start command while ops run, restarted with the same command and prefix (snapshots ${snapshots ? 'on' : 'off'})`, function () {
    this.timeout(300_000);
    // The API key of test/helpers/client.ts; the agent's default timeout (30 s), so the restarted
    // agent claims its id back before any reaper would act: the case where the futures hung.
    const server = new E2EServer({ TB_API_KEYS: API_KEY, TB_SNAPSHOT_EVERY_STEPS: snapshots ? '1' : '0' });
    const redis = new Redis(REDIS_URL);
    const names = new Names(server.prefix);
    let engine = 0;
    after(async () => {
      // A failure before the kill leaves the engine stopped: a graceful stop would wait for its op.
      if (engine) await server.kill('SIGKILL');
      await server.destroy();
      redis.disconnect();
    });

    it(`the running op fails with OUTCOME_UNKNOWN, ${snapshots ? 'the unstarted ones run on the recovered model' : 'the unstarted ones with the model lost'}, the queue is left empty and training goes on`, async () => {
      await server.start();
      const client = new Client(server);
      await client.init();
      const m = await client.createModel(1);
      const before = await client.train(m, 1);
      expect(before[0]).to.be.a('number');

      const agentId = `agent-${server.prefix}`;
      const prefix = `${names.bull}:${names.trainQueue(agentId)}:`;
      engine = Number(spawnSync('pgrep', ['-P', String(server.pid), '-f', 'tinker_engine'], { encoding: 'utf8' }).stdout.trim().split('\n')[0]);
      expect(engine, 'the engine process').to.be.above(0);
      process.kill(engine, 'SIGSTOP'); // the next op stays in the engine
      const running = await client.submitFb(m);
      const outcomes = new Outcomes(redis, names, 60);
      await waitFor('the op claimed', async () => (await outcomes.get(decodeRequestId(running)!.jobId))?.state === 'running');
      const ahead = await client.submitOptim(m);
      const waiting = await client.submitFb(m);
      // All three on the queue: the consumer holds some ahead of the running one, the rest wait.
      await waitFor('the ops queued', async () => (await redis.llen(`${prefix}active`)) + (await redis.llen(`${prefix}wait`)) === 3);
      expect(await redis.llen(`${prefix}active`)).to.be.at.least(2);

      const incarnation = async () => JSON.parse((await redis.hget(names.agents(), agentId)) ?? '{}').incarnation as string | undefined;
      const dead = await incarnation();
      await server.kill('SIGKILL');
      engine = 0;
      const restartedAt = Date.now();
      await server.start();
      const readyS = (Date.now() - restartedAt) / 1000;
      // Ready means the new process's agent serves: not the dead one's record, still live in Redis for its timeout.
      const now = await incarnation();
      expect(now).to.be.a('string').and.not.equal(dead);

      const [r1, r2, r3] = await Promise.all([running, ahead, waiting].map((id) => client.result(id, 'application/json', 120_000)));
      console.log(`      [node-crash] restart -> healthz ready ${readyS.toFixed(1)} s, -> all 3 futures answered ${((Date.now() - restartedAt) / 1000).toFixed(1)} s`);
      expectUnknownOutcome(r1!, /the agent process that was running it \([0-9a-f-]+\) ended before recording its outcome/);
      if (snapshots) {
        // The model is back as of its snapshot after the first step; the unknown forward_backward left no gradient.
        expect(r2!.json, JSON.stringify(r2!.json)).to.deep.include({ type: 'optim_step' });
        expect(r2!.json.metrics.grad_norm).to.equal(0);
        expect(r3!.json, JSON.stringify(r3!.json)).to.have.nested.property('metrics.loss:sum');
        const recoveredLoss = r3!.json.metrics['loss:sum'] as number;
        // A twin on the restarted node, given the same ops without the unknown one, reads the same loss, bit for bit.
        const twin = await client.createModel(1);
        await client.train(twin, 1);
        await client.optim(twin);
        expect(recoveredLoss).to.equal(await client.loss(await client.submitFb(twin)));
        // And the same model id trains on.
        await client.optim(m);
        const more = await client.train(m, 3);
        expect(more[2]).to.be.below(more[0]!);
      } else {
        for (const r of [r2!, r3!]) {
          expect(r.json, JSON.stringify(r.json)).to.include({ category: 'server', code: 'UNAVAILABLE' });
          expect(r.json.error).to.match(/^model .* is unavailable: its worker agent restarted; load it from a saved checkpoint/);
        }
      }
      // Nothing is left on the training queue.
      await waitFor('the queue emptied', async () => (await redis.llen(`${prefix}active`)) + (await redis.llen(`${prefix}wait`)) === 0, 30_000);
      // The restarted node trains new models: the loss goes down.
      const fresh = await client.createModel(2);
      const losses = await client.train(fresh, 3);
      expect(losses[2]).to.be.below(losses[0]!);
    });
  });
}
