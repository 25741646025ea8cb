import { QueueEvents } from 'bullmq';
import type { Redis } from 'ioredis';
import type { FutureRef } from './futures.js';
import type { Names } from './names.js';

/**
 * Completion signals, so a waiting `retrieve_future` answers the moment its op finishes, never by
 * polling:
 * - a training op's outcome becoming final is published by the script that records it
 *   (queues/lua/outcome-finish.lua) on one channel per deployment, with the final record itself
 *   when it is small (the waiter answers from it, no read back); each API process holds one
 *   subscriber connection for it;
 * - a sample's end comes from its BullMQ queue's events (one listener per sample queue, created
 *   on first use, reading from the stream's current end).
 * A waiter is registered before the caller reads the state a second time, so a signal sent between
 * the two reads is not lost.
 */
export class Completions {
  private subscriber: Promise<Redis> | null = null;
  private readonly events = new Map<string, Promise<QueueEvents>>();
  private readonly waiters = new Map<string, Set<(record?: string) => void>>();

  constructor(
    private readonly redis: Redis,
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

  /** The shared listener of one sample queue; it reads from the stream's current end. */
  private listen(queue: string): Promise<QueueEvents> {
    let p = this.events.get(queue);
    if (!p) {
      p = (async () => {
        // Start at the last event already in the stream, not at '$': an event written between
        // "ready" and the first blocking read is then still delivered.
        const last = await this.redis.xrevrange(`${this.names.bull}:${queue}:events`, '+', '-', 'COUNT', 1);
        const qe = new QueueEvents(queue, { connection: this.blockingConnection(), prefix: this.names.bull, lastEventId: last[0]?.[0] ?? '0-0' });
        qe.on('completed', ({ jobId }) => this.notify(jobId));
        qe.on('failed', ({ jobId }) => this.notify(jobId));
        // Connection errors (Redis unreachable) are reported by the app's own connection watch.
        qe.on('error', () => undefined);
        await qe.waitUntilReady();
        return qe;
      })();
      this.events.set(queue, p);
      p.catch(() => this.events.delete(queue));
    }
    return p;
  }

  /**
   * Registers a waiter for the job's end; `woken` resolves on its signal, with the training op's
   * final outcome record (JSON) when the signal carried it. Resolves once the signal can no longer
   * be missed (read the state after this). `cancel` removes the waiter.
   */
  async watch(ref: FutureRef): Promise<{ woken: Promise<string | undefined>; cancel: () => void }> {
    if (ref.queue.startsWith('train-')) await this.subscribe();
    else await this.listen(ref.queue);
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
    const all = await Promise.allSettled([...this.events.values()]);
    await Promise.all(all.map((r) => (r.status === 'fulfilled' ? r.value.close() : undefined)));
    this.events.clear();
    const sub = this.subscriber;
    this.subscriber = null;
    if (sub) await sub.then((c) => c.unsubscribe().catch(() => undefined)).catch(() => undefined);
  }
}
