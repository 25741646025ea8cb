import { execFileSync } from 'node:child_process';
import { expect } from 'chai';
import { TINY_MODEL_ALIAS } from '../scripts/stack.js';
import { awaitFuture, call, startStack, type TestStack } from './helpers/stack.js';
import { decodeForwardBackwardOutput, encodeForwardBackward } from './helpers/wire.js';

/** The agent supervises its engine: a dead engine loses its models (said clearly) and is restarted. */
describe('worker agent supervision', function () {
  this.timeout(180_000);
  let s: TestStack;
  let sessionId: string;
  before(async () => {
    s = await startStack({ longPollMs: 1_000 });
    sessionId = (await call(s.baseUrl, 'POST', '/create_session', { tags: [] })).json.session_id;
  });
  after(async () => s?.stop());

  const result = (requestId: string, accept?: string) => awaitFuture(s.baseUrl, requestId, accept);
  async function createModel(seq: number): Promise<string> {
    const r = await call(s.baseUrl, 'POST', '/create_model', { session_id: sessionId, model_seq_id: seq, base_model: TINY_MODEL_ALIAS, lora_config: { rank: 2, seed: 0 } });
    const done = await result(r.json.request_id);
    expect(done.json, JSON.stringify(done.json)).to.have.property('model_id');
    return done.json.model_id;
  }
  const fb = (modelId: string, seqId: number) =>
    call(s.baseUrl, 'POST', '/forward_backward', undefined, { raw: encodeForwardBackward({ modelId, seqId, data: [{ tokens: [3, 4, 5], targets: [4, 5, 6] }] }) });

  it('marks the models of a killed engine lost, restarts it, and serves new models', async () => {
    const a = await createModel(0);
    expect((await result((await fb(a, 1)).json.request_id, 'application/x-protobuf')).status).to.equal(200);
    const pids = execFileSync('pgrep', ['-P', String(process.pid), '-f', 'tinker_engine'], { encoding: 'utf8' }).trim().split('\n');
    expect(pids).to.have.length(1);
    process.kill(Number(pids[0]), 'SIGKILL');
    // The agent notices the exit and records why the model is gone, once the restarted engine is up (a
    // new engine process imports torch first: seconds on a loaded machine). The bound only keeps a
    // broken agent from hanging the test.
    let lost: string | null = null;
    for (let i = 0; i < 1200 && !lost; i++) {
      lost = (await s.built.ctx.registry.models.get(a))?.lost_reason ?? null;
      if (!lost) await new Promise((r) => setTimeout(r, 50));
    }
    expect(lost).to.match(/engine process exited \(code null, signal SIGKILL\)/);

    // A new model is served once the engine is back (create_model waits for the restart).
    const b = await createModel(1);
    const out = await result((await fb(b, 1)).json.request_id, 'application/x-protobuf');
    expect(decodeForwardBackwardOutput(out.body).logprobs[0]).to.have.length(3);
    const newPids = execFileSync('pgrep', ['-P', String(process.pid), '-f', 'tinker_engine'], { encoding: 'utf8' }).trim().split('\n');
    expect(newPids).to.have.length(1).and.not.include(pids[0]);

    // The old model's weights died with the engine: its next op gets a future that fails with a message
    // that says so (an HTTP 5xx would make the SDK retry for minutes), and the op after it does too.
    for (const seq of [2, 3]) {
      const sub = await fb(a, seq);
      expect(sub.status).to.equal(200);
      const r = await result(sub.json.request_id, 'application/x-protobuf');
      expect(r.json).to.include({ category: 'server', code: 'UNAVAILABLE' });
      expect(r.json.error).to.match(/unavailable: the engine process exited .* load it from a saved checkpoint/);
    }
  });
});
