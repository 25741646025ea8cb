import { Queue } from 'bullmq';
import type { Redis } from 'ioredis';
import type { Names } from '../contract/names.js';

/**
 * Read-only views of a deployment's queues for operators (the CLI's `status`, `/metrics`, the
 * `/admin` dashboard): which BullMQ queues exist under the prefix and how many jobs each holds.
 */

/** Every BullMQ queue of the deployment: those of live agents and any that holds jobs or events. */
export async function queueNames(redis: Redis, names: Names): Promise<string[]> {
  const found = new Set<string>();
  const head = `${names.bull}:`;
  for (const suffix of ['meta', 'id', 'events']) {
    let cursor = '0';
    do {
      const [next, keys] = await redis.scan(cursor, 'MATCH', `${head}*:${suffix}`, 'COUNT', 500);
      cursor = next;
      for (const k of keys) {
        const q = k.slice(head.length, k.length - suffix.length - 1);
        if (/^(train|sample)-[A-Za-z0-9_.-]+$/.test(q)) found.add(q);
      }
    } while (cursor !== '0');
  }
  return [...found].sort();
}

export type QueueCounts = { queue: string; waiting: number; active: number; delayed: number; prioritized: number; completed: number; failed: number };

/** Job counts of each queue (one short-lived Queue object per queue; nothing is created in Redis). */
export async function queueCounts(redis: Redis, names: Names, queues?: string[]): Promise<QueueCounts[]> {
  const list = queues ?? (await queueNames(redis, names));
  return Promise.all(
    list.map(async (name) => {
      const q = new Queue(name, { connection: redis, prefix: names.bull });
      try {
        const c = await q.getJobCounts('waiting', 'active', 'delayed', 'prioritized', 'completed', 'failed');
        return {
          queue: name,
          waiting: c.waiting ?? 0,
          active: c.active ?? 0,
          delayed: c.delayed ?? 0,
          prioritized: c.prioritized ?? 0,
          completed: c.completed ?? 0,
          failed: c.failed ?? 0,
        };
      } finally {
        await q.close();
      }
    }),
  );
}
