import { expect } from 'chai';
import type { SampleJob, SampleResult } from '../queues/contract/schemas.js';
import { SampleGatherer } from '../workers/sample-gather.js';

/**
 * The gatherer while a batch is in the engine (workers/sample-gather.ts): the jobs of a burst that
 * arrive one by one after it join it in one engine call, not one call each, and the queue is not
 * asked meanwhile; and, with a hold, the first job to reach an idle engine waiting for the rest of
 * its burst. No Redis and no engine: the gatherer's own rules, with a run that the test ends. The
 * waits order timers (a wait longer than the timer it follows), they time nothing.
 */
function job(first: number): SampleJob {
  return {
    op: 'sample',
    sampling_session_id: 's',
    seq_id: first,
    base_model: 'b',
    adapter_dir: null,
    model_path: null,
    prompt: [first, 2],
    num_samples: 1,
    sampling_params: { max_tokens: 4, temperature: 1, top_k: -1, top_p: 1, seed: 1, stop_tokens: [], stop_strings: [], stop_at_eos: true },
    prompt_logprobs: false,
    topk_prompt_logprobs: 0,
  };
}

const answer = (j: SampleJob): SampleResult => ({
  sequences: [{ tokens: j.prompt, logprobs: j.prompt.map(() => 0), stop_reason: 'length' }],
  prompt_logprobs: null,
  topk_prompt_logprobs: null,
});

/**
 * A gatherer (window 20 ms, longest wait 100 ms, the given hold) whose engine calls are recorded by
 * their jobs' first prompt tokens and stay in the engine until the test ends them; the queue it
 * asks is always empty, and the asks are counted.
 */
function recording(holdMs = 0) {
  const batches: number[][] = [];
  const ends: (() => void)[] = [];
  const counts = { asked: 0 };
  const g = new SampleGatherer({
    windowMs: 20,
    maxWaitMs: 100,
    holdMs,
    tokenBudget: 1_000,
    waiting: async () => {
      counts.asked++;
      return 0;
    },
    run: (jobs) => {
      batches.push(jobs.map((j) => j.prompt[0]!));
      return new Promise((resolve) => ends.push(() => resolve(jobs.map(answer))));
    },
  });
  return { g, batches, ends, counts };
}

describe('sample gathering while a batch is in the engine', () => {
  it('gathers the jobs that arrive one by one into one call, without asking the queue', async () => {
    const { g, batches, ends, counts } = recording();
    const first = g.submit(job(1));
    await new Promise((r) => setImmediate(r));
    // Nothing waited and nothing ran: the lone job went at once, after one look at the queue.
    expect(batches).to.deep.equal([[1]]);
    expect(counts.asked).to.equal(1);
    // Three more arrive one by one while it runs: each would have gone alone before.
    const rest: Promise<SampleResult>[] = [];
    for (const k of [2, 3, 4]) {
      rest.push(g.submit(job(k)));
      await new Promise((r) => setImmediate(r));
    }
    expect(batches).to.deep.equal([[1]]);
    await new Promise((r) => setTimeout(r, 60)); // past the window after the last arrival
    expect(batches).to.deep.equal([[1], [2, 3, 4]]);
    expect(counts.asked).to.equal(1);
    ends.forEach((end) => end());
    expect((await first).sequences[0]!.tokens).to.deep.equal([1, 2]);
    expect((await Promise.all(rest)).map((r) => r.sequences[0]!.tokens[0])).to.deep.equal([2, 3, 4]);
    // Both calls have ended: a lone job goes at once again.
    const again = g.submit(job(5));
    await new Promise((r) => setImmediate(r));
    expect(batches).to.deep.equal([[1], [2, 3, 4], [5]]);
    expect(counts.asked).to.equal(2);
    ends[2]!();
    await again;
  });

  it('holds the first job to reach an idle engine for company, without asking the queue', async () => {
    const { g, batches, ends, counts } = recording(30);
    // The first job of a burst is held: nothing goes at once (without the hold it would go alone).
    const burst = [g.submit(job(1))];
    await new Promise((r) => setImmediate(r));
    expect(batches).to.deep.equal([]);
    // The rest of the burst arrives one by one within the hold: all go in one call.
    for (const k of [2, 3]) {
      burst.push(g.submit(job(k)));
      await new Promise((r) => setImmediate(r));
    }
    expect(batches).to.deep.equal([]);
    await new Promise((r) => setTimeout(r, 150)); // past the hold, the window and the longest wait
    expect(batches).to.deep.equal([[1, 2, 3]]);
    ends[0]!();
    expect((await Promise.all(burst)).map((r) => r.sequences[0]!.tokens[0])).to.deep.equal([1, 2, 3]);
    // A lone job is held too, and goes alone once the hold has passed.
    const lone = g.submit(job(4));
    await new Promise((r) => setImmediate(r));
    expect(batches).to.deep.equal([[1, 2, 3]]);
    await new Promise((r) => setTimeout(r, 60));
    expect(batches).to.deep.equal([[1, 2, 3], [4]]);
    ends[1]!();
    await lone;
    // With a hold the queue is never asked (whatever waits there, the job waits anyway).
    expect(counts.asked).to.equal(0);
  });
});
