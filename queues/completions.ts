import type { Redis } from 'ioredis';
import type { Failure } from './errors.js';
import type { FutureRef } from './futures.js';
import type { Names } from './names.js';
import { SIGNALLED_RECORD_MAX_BYTES, type Outcome } from './outcomes.js';

/**
 * Completion signals, so a waiting `retrieve_future` answers the moment its op finishes, never by
 * polling. Both come on one channel per deployment (`Names.outcomesChannel`), to which each API
 * process holds one subscriber connection, as `<job id>` or `<job id> <final record>`:
 * - a training op's outcome becoming final is published by the script that records it
 *   (queues/lua/outcome-finish.lua), with the final record itself when it is small;
 * - a sample's end is published by the agent once BullMQ has recorded it (`sampleEndSignal`, in
 *   the transaction that records the job's metrics), with its result or failure when small.
 * The waiter answers from a record without reading it back. A waiter is registered before the
 * caller reads the state, so a signal sent between the two is not lost.
 */

/** How a sample job ended, as its completion signal carries it. */
export type SampleEnd = { state: 'done'; result: unknown } | ({ state: 'failed' } & Failure);

/**
 * The channel and message that signal a sample job's end: the end as a final record of the
 * outcome's shape (queues/outcomes.ts; not stored anywhere) when it is at most
 * SIGNALLED_RECORD_MAX_BYTES, else the job id alone (the waiter then reads the finished job).
 * Send it after the job's end is recorded in Redis.
 */
export function sampleEndSignal(names: Names, jobId: string, agentId: string, end: SampleEnd): [channel: string, message: string] {
  const record: Outcome = { ...end, op: 'sample', agent_id: agentId, token: jobId, at: new Date().toISOString() };
  const json = JSON.stringify(record);
  const small = json.length <= SIGNALLED_RECORD_MAX_BYTES && Buffer.byteLength(json) <= SIGNALLED_RECORD_MAX_BYTES;
  return [names.outcomesChannel(), small ? `${jobId} ${json}` : jobId];
}

export class Completions {
  private subscriber: Promise<Redis> | null = null;
  private readonly waiters = new Map<string, Set<(record?: string) => void>>();

  constructor(
    private readonly blockingConnection: () => Redis,
    private readonly names: Names,
  ) {}

  private notify(jobId: string, record?: string): void {
    const set = this.waiters.get(jobId);
    if (set) for (const wake of set) wake(record);
  }

  private subscribe(): Promise<Redis> {
    if (!this.subscriber) {
      const p = (async () => {
        const c = this.blockingConnection();
        // '<job id>' or '<job id> <final outcome record>' (job ids hold no space).
        c.on('message', (_channel: string, msg: string) => {
          const sp = msg.indexOf(' ');
          if (sp === -1) this.notify(msg);
          else this.notify(msg.slice(0, sp), msg.slice(sp + 1));
        });
        await c.subscribe(this.names.outcomesChannel());
        return c;
      })();
      this.subscriber = p;
      // A subscription that failed is dropped, so the next wait tries again.
      p.catch(() => (this.subscriber = null));
    }
    return this.subscriber;
  }

  /**
   * Registers a waiter for the job's end; `woken` resolves on its signal, with the final record
   * (JSON) when the signal carried it. Resolves once the signal can no longer be missed (read the
   * state after this). `cancel` removes the waiter.
   */
  async watch(ref: FutureRef): Promise<{ woken: Promise<string | undefined>; cancel: () => void }> {
    await this.subscribe();
    let wake!: (record?: string) => void;
    const woken = new Promise<string | undefined>((resolve) => (wake = resolve));
    const set = this.waiters.get(ref.jobId) ?? new Set();
    set.add(wake);
    this.waiters.set(ref.jobId, set);
    return {
      woken,
      cancel: () => {
        set.delete(wake);
        if (set.size === 0 && this.waiters.get(ref.jobId) === set) this.waiters.delete(ref.jobId);
      },
    };
  }

  async close(): Promise<void> {
    const sub = this.subscriber;
    this.subscriber = null;
    if (sub) await sub.then((c) => c.unsubscribe().catch(() => undefined)).catch(() => undefined);
  }
}
