import { performance } from 'node:perf_hooks';
import { randomUUID } from 'node:crypto';
import { Redis } from 'ioredis';
import { Names } from '../queues/contract/names.js';
import { readMetrics, recordJob, recordTokens } from '../queues/runtime/metrics.js';

/**
 * What the operation metrics cost (queues/runtime/metrics.ts) against the local Redis: the Redis round
 * trips an agent adds per finished job (`recordJob`, `recordTokens`; not awaited by the job) and
 * what one `/metrics` scrape spends reading them (`readMetrics`), with `jobs` recorded over 5 ops.
 *
 *   node --import tsx bench/metrics.ts [jobs=2000]
 */
const jobs = Number(process.argv[2] ?? 2000);
const OPS = ['forward_backward', 'optim_step', 'sample', 'create_model', 'save_weights_for_sampler'];

async function main(): Promise<void> {
  const redis = new Redis(process.env.REDIS_URL ?? 'redis://127.0.0.1:6379');
  const names = new Names(`bench-metrics-${randomUUID().slice(0, 8)}`);
  try {
    let t = performance.now();
    for (let i = 0; i < jobs; i++) {
      const now = Date.now();
      await recordJob(redis, names, { op: OPS[i % OPS.length]!, status: 'ok', enqueuedAt: now - 50 - (i % 300), startedAt: now - 40, finishedAt: now });
    }
    const perJob = (performance.now() - t) / jobs;
    t = performance.now();
    for (let i = 0; i < jobs; i++) await recordTokens(redis, names, 'sampled', 100);
    const perTokens = (performance.now() - t) / jobs;
    const reads: number[] = [];
    for (let i = 0; i < 21; i++) {
      t = performance.now();
      await readMetrics(redis, names);
      reads.push(performance.now() - t);
    }
    reads.sort((a, b) => a - b);
    console.log(
      JSON.stringify({ jobs, record_job_ms: +perJob.toFixed(3), record_tokens_ms: +perTokens.toFixed(3), read_metrics_median_ms: +reads[10]!.toFixed(2), read_metrics_max_ms: +reads[20]!.toFixed(2) }),
    );
  } finally {
    let cursor = '0';
    do {
      const [next, keys] = await redis.scan(cursor, 'MATCH', `${names.prefix}:*`, 'COUNT', 500);
      cursor = next;
      if (keys.length) await redis.del(...keys);
    } while (cursor !== '0');
    redis.disconnect();
  }
}

main().catch((e) => {
  console.error(e);
  process.exit(1);
});
