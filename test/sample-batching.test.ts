import { expect } from 'chai';
import type { SampleJob, SampleResult } from '../queues/contract/schemas.js';
import { TINY_MODEL_ALIAS } from '../scripts/stack.js';
import { SampleGatherer, jobTokens } from '../workers/sample-gather.js';
import { awaitFuture, call, startStack, type TestStack } from './helpers/stack.js';

function job(prompt: number[], maxTokens: number, numSamples = 1): SampleJob {
  return {
    op: 'sample',
    sampling_session_id: 's',
    seq_id: 0,
    base_model: 'b',
    adapter_dir: null,
    model_path: null,
    prompt,
    num_samples: numSamples,
    sampling_params: { max_tokens: maxTokens, temperature: 1, top_k: -1, top_p: 1, seed: 1, stop_tokens: [], stop_strings: [], stop_at_eos: true },
    prompt_logprobs: false,
    topk_prompt_logprobs: 0,
  };
}

const answer = (j: SampleJob): SampleResult => ({
  sequences: [{ tokens: j.prompt, logprobs: j.prompt.map(() => 0), stop_reason: 'length' }],
  prompt_logprobs: null,
  topk_prompt_logprobs: null,
});

describe('sample gathering (agent side)', () => {
  function gatherer(waiting: number, tokenBudget = 1_000, windowMs = 30) {
    const batches: number[][] = [];
    const asked = { waiting: 0 };
    const g = new SampleGatherer({
      windowMs,
      maxWaitMs: windowMs * 5,
      tokenBudget,
      waiting: async () => {
        asked.waiting++;
        return waiting;
      },
      run: async (jobs) => {
        batches.push(jobs.map((j) => j.prompt[0]!));
        return jobs.map((j) => (j.prompt[0] === 99 ? new Error('bad request 99') : answer(j)));
      },
    });
    return { g, batches, asked };
  }

  it('sends a lone job at once when nothing waits in the queue', async () => {
    // A window of an hour: the batch went out before any timer could close it.
    const { g, batches, asked } = gatherer(0, 1_000, 3_600_000);
    const r = g.submit(job([1, 2], 4));
    await new Promise((resolve) => setImmediate(resolve));
    expect(batches).to.deep.equal([[1]]);
    expect(asked.waiting).to.equal(1);
    expect((await r).sequences[0]!.tokens).to.deep.equal([1, 2]);
  });

  it('gathers jobs while others wait, each settling with its own result or error', async () => {
    const { g, batches } = gatherer(3);
    const out = await Promise.allSettled([g.submit(job([1], 4)), g.submit(job([99], 4)), g.submit(job([3], 4))]);
    expect(batches).to.deep.equal([[1, 99, 3]]);
    expect(out.map((o) => o.status)).to.deep.equal(['fulfilled', 'rejected', 'fulfilled']);
    expect((out[1] as PromiseRejectedResult).reason.message).to.equal('bad request 99');
  });

  it('closes a batch before the token budget is exceeded', async () => {
    expect(jobTokens(job([1, 2, 3], 7, 2))).to.equal(20);
    const { g, batches } = gatherer(5, 25);
    await Promise.all([g.submit(job([1, 2, 3], 7)), g.submit(job([2, 2, 3], 7)), g.submit(job([3, 2, 3], 7))]);
    expect(batches).to.deep.equal([[1, 2], [3]]);
  });
});

/** Through the real stack: concurrent sample requests batch together and give what each gives alone. */
describe('batched sampling through the stack', function () {
  this.timeout(300_000);
  let s: TestStack;
  let samplingSessionId: string;
  before(async () => {
    s = await startStack({ longPollMs: 5_000, env: { TB_SAMPLE_CONCURRENCY: '16' } });
    const session = (await call(s.baseUrl, 'POST', '/create_session', { tags: [] })).json.session_id;
    const sc = await call(s.baseUrl, 'POST', '/create_sampling_session', { session_id: session, sampling_session_seq_id: 0, base_model: TINY_MODEL_ALIAS });
    samplingSessionId = sc.json.sampling_session_id;
  });
  after(async () => s?.stop());

  let seq = 0;
  async function sample(prompt: number[], maxTokens: number, seed: number, numSamples = 1): Promise<number[][]> {
    const sub = await call(s.baseUrl, 'POST', '/asample', {
      prompt: { chunks: [{ type: 'encoded_text', tokens: prompt }] },
      num_samples: numSamples,
      sampling_params: { max_tokens: maxTokens, temperature: 1, seed, stop: [] },
      sampling_session_id: samplingSessionId,
      seq_id: seq++,
    });
    const r = await awaitFuture(s.baseUrl, sub.json.request_id, 'application/json', 200);
    expect(r.status, r.body.toString()).to.equal(200);
    return (r.json.sequences as { tokens: number[]; logprobs: number[] }[]).map((x) => {
      expect(x.logprobs).to.have.length(x.tokens.length);
      return x.tokens;
    });
  }

  it('gives every concurrent request the tokens it gets alone (same seed)', async () => {
    const reqs = Array.from({ length: 10 }, (_, i) => ({ prompt: Array.from({ length: 1 + (i % 5) }, (_, j) => 7 + i * 13 + j), max: 4 + i, n: 1 + (i % 3), seed: i }));
    const together = await Promise.all(reqs.map((r) => sample(r.prompt, r.max, r.seed, r.n)));
    for (const [i, r] of reqs.entries()) {
      const alone = await sample(r.prompt, r.max, r.seed, r.n);
      expect(together[i], `request ${i}`).to.deep.equal(alone);
      for (const t of alone) expect(t).to.have.length(r.max); // stop [] disables EOS
    }
  });
});
