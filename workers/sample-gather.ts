import type { SampleJob, SampleResult } from '../queues/contract/schemas.js';

/**
 * Gathers the sample jobs an agent holds for one base model into batches for one engine call.
 *
 * - A job that arrives when nothing else is gathering and no batch of this gatherer is in the engine
 *   waits up to `holdMs` for company before its batch goes: a client's burst of concurrent requests
 *   arrives one by one over tens of milliseconds, and a generation started by the first alone lasts
 *   as long as the burst's spread plus its own length, every decode step costing what a full one
 *   does (docs/benchmarks.md, "Holding the first job of a burst"). With `holdMs` 0 such a job goes
 *   out at once unless jobs wait in the model's queue (one look at it).
 * - Otherwise the batch stays open while jobs keep arriving: it closes `windowMs` after the last
 *   arrival, `maxWaitMs` after the first, or as soon as the next job would push it past
 *   `tokenBudget` (prompt + max_tokens, times num_samples, summed). While a batch is in the engine
 *   the jobs of a burst that arrive one by one (as a client's concurrent requests do) join it
 *   together, in one engine call, not one call each: every call costs the agent and the engine a
 *   frame, a prefill pass and a merge into the running batch (bench/request-cost.ts). The queue is
 *   not asked then (a Redis round trip that would not change the answer).
 * - Each job settles with its own result or its own error.
 */
export type GatherOptions = {
  windowMs: number;
  maxWaitMs: number;
  /** How long the first job to reach an idle engine waits for company (at most `maxWaitMs`); 0: it goes at once if the queue is empty. @defaultValue 0 */
  holdMs?: number;
  tokenBudget: number;
  /**
   * Jobs waiting in the queue that this agent may still take: not beyond its share of the queue
   * (workers/agent/sample-share.ts), since the others are for other agents (a hint; errors count as 0).
   */
  waiting: () => Promise<number>;
  /** One engine call for the batch: one result or one error per job, in order. */
  run: (jobs: SampleJob[]) => Promise<(SampleResult | Error)[]>;
};

type Entry = { job: SampleJob; tokens: number; resolve: (r: SampleResult) => void; reject: (e: Error) => void };

export function jobTokens(job: SampleJob): number {
  return job.num_samples * (job.prompt.length + job.sampling_params.max_tokens);
}

export class SampleGatherer {
  private open: Entry[] = [];
  private openTokens = 0;
  private firstAt = 0;
  private timer: NodeJS.Timeout | undefined;
  private deciding = false;
  /** Batches sent to the engine whose results have not come back. */
  private running = 0;

  constructor(private readonly opts: GatherOptions) {}

  submit(job: SampleJob): Promise<SampleResult> {
    return new Promise<SampleResult>((resolve, reject) => {
      const entry: Entry = { job, tokens: jobTokens(job), resolve, reject };
      if (this.open.length && this.openTokens + entry.tokens > this.opts.tokenBudget) this.flush();
      this.open.push(entry);
      this.openTokens += entry.tokens;
      if (this.open.length === 1) {
        this.firstAt = Date.now();
        void this.decide();
      } else if (!this.deciding) {
        this.arm();
      }
    });
  }

  /** First job of a batch: wait for company (`holdMs`), else go now unless a batch is in the engine or others wait in the queue. */
  private async decide(): Promise<void> {
    if (this.opts.windowMs <= 0) return this.flush();
    if (this.running > 0) return this.arm();
    if ((this.opts.holdMs ?? 0) > 0) return this.arm(this.opts.holdMs);
    this.deciding = true;
    let waiting = 0;
    try {
      waiting = await this.opts.waiting();
    } catch {
      waiting = 0;
    } finally {
      this.deciding = false;
    }
    if (!this.open.length) return; // flushed by the token budget meanwhile
    if (waiting === 0 && this.open.length === 1) return this.flush();
    this.arm();
  }

  /** Closes the open batch `afterMs` from now (default: the window after the last arrival), at most `maxWaitMs` after its first job. */
  private arm(afterMs = this.opts.windowMs): void {
    clearTimeout(this.timer);
    const left = this.firstAt + this.opts.maxWaitMs - Date.now();
    this.timer = setTimeout(() => this.flush(), Math.max(0, Math.min(afterMs, left)));
  }

  private flush(): void {
    clearTimeout(this.timer);
    this.timer = undefined;
    const batch = this.open;
    this.open = [];
    this.openTokens = 0;
    if (!batch.length) return;
    this.running++;
    const ran = this.opts.run(batch.map((e) => e.job)).finally(() => this.running--);
    ran.then(
      (results) => {
        batch.forEach((e, i) => {
          const r = results[i];
          if (r === undefined) e.reject(new Error(`the engine returned ${results.length} results for ${batch.length} requests`));
          else if (r instanceof Error) e.reject(r);
          else e.resolve(r);
        });
      },
      (err: Error) => batch.forEach((e) => e.reject(err)),
    );
  }
}
