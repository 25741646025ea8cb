import type { RequestHandler } from 'express';
import { collectDefaultMetrics, Gauge, Registry as PromRegistry, type Metric } from 'prom-client';
import { queueCounts } from '../queues/runtime/inspect.js';
import { LATENCY_BUCKETS_S, PHASES, readAgentStats, readMetrics } from '../queues/runtime/metrics.js';
import type { ApiContext } from './context.js';

/**
 * `GET /metrics` in the Prometheus text format (prom-client). Operation figures are the whole
 * deployment's, read from Redis at each scrape (agents record them, queues/runtime/metrics.ts), so every
 * API process reports the same numbers; `process_*` and `nodejs_*` are this API process's own.
 *
 * - `tb_jobs_total{op,status}`: finished jobs (`ok`, `user_error`, `server_error`);
 * - `tb_job_duration_seconds{op,phase}`: histogram; `phase` is `queue_wait` (enqueued → taken by
 *   an agent), `engine` (taken → finished) or `total` (enqueued → finished);
 * - `tb_queue_jobs{queue,state}`: jobs per queue and state (`waiting`, `active`, `delayed`, `failed`, `completed`);
 * - `tb_agents_alive`, `tb_agent_engine_rss_bytes{agent,engine,device}`, `tb_agent_gpu_memory_bytes{…}`;
 * - `tb_agent_gpu_turns{agent,event}` and `tb_agent_gpu_turn_seconds{agent,phase}` for agents taking GPU turns (workers/gpu-turns.ts);
 * - `tb_tokens_total{kind}` (`sampled`, `trained`) and `tb_tokens_per_second{kind}` over the last 60 s.
 */
export function metricsHandler(ctx: ApiContext): RequestHandler {
  const reg = new PromRegistry();
  collectDefaultMetrics({ register: reg });
  let snapshot: Awaited<ReturnType<typeof readMetrics>> | null = null;

  // Histograms kept in Redis are exported as they are: prom-client's Histogram only counts observations of this process.
  const durations = {
    name: 'tb_job_duration_seconds',
    help: 'Job latency by operation and phase: queue_wait (enqueued to taken by an agent), engine (taken to finished), total (enqueued to finished)',
    type: 'histogram',
    aggregator: 'sum',
    get: async () => {
      const values: { metricName: string; labels: Record<string, string | number>; value: number }[] = [];
      for (const phase of PHASES)
        for (const [op, h] of snapshot?.latency[phase] ?? []) {
          LATENCY_BUCKETS_S.forEach((le, i) => values.push({ metricName: 'tb_job_duration_seconds_bucket', labels: { op, phase, le }, value: h.buckets[i]! }));
          values.push({ metricName: 'tb_job_duration_seconds_bucket', labels: { op, phase, le: '+Inf' }, value: h.buckets[LATENCY_BUCKETS_S.length]! });
          values.push({ metricName: 'tb_job_duration_seconds_sum', labels: { op, phase }, value: h.sumMs / 1000 });
          values.push({ metricName: 'tb_job_duration_seconds_count', labels: { op, phase }, value: h.count });
        }
      return { name: durations.name, help: durations.help, type: 'histogram', values, aggregator: 'sum' };
    },
    reset: () => undefined,
  };
  reg.registerMetric(durations as unknown as Metric);

  /** A counter whose value is kept in Redis (prom-client's Counter can only be incremented by this process). */
  const counter = (name: string, help: string, values: () => { labels: Record<string, string>; value: number }[]) => ({
    name,
    help,
    type: 'counter',
    aggregator: 'sum',
    get: async () => ({ name, help, type: 'counter', values: values(), aggregator: 'sum' }),
    reset: () => undefined,
  });
  reg.registerMetric(
    counter('tb_jobs_total', 'Finished jobs by operation and status (ok, user_error, server_error)', () =>
      (snapshot?.jobs ?? []).map((j) => ({ labels: { op: j.op, status: j.status }, value: j.count })),
    ) as unknown as Metric,
  );
  reg.registerMetric(
    counter('tb_tokens_total', 'Tokens sampled (generated) and trained (forward_backward inputs, not forward-only)', () =>
      (['sampled', 'trained'] as const).map((kind) => ({ labels: { kind }, value: snapshot?.tokens[kind].total ?? 0 })),
    ) as unknown as Metric,
  );
  const queue = new Gauge({ name: 'tb_queue_jobs', help: 'Jobs in each queue by state', labelNames: ['queue', 'state'], registers: [reg] });
  const alive = new Gauge({ name: 'tb_agents_alive', help: 'Worker agents whose heartbeat is current', registers: [reg] });
  const rss = new Gauge({ name: 'tb_agent_engine_rss_bytes', help: "Resident memory of each agent's engine processes", labelNames: ['agent', 'engine', 'device'], registers: [reg] });
  const gpu = new Gauge({ name: 'tb_agent_gpu_memory_bytes', help: "GPU memory held by each agent's engine processes (nvidia-smi)", labelNames: ['agent', 'engine', 'device'], registers: [reg] });
  const turns = new Gauge({ name: 'tb_agent_gpu_turns', help: 'GPU turns of each agent that takes turns on a shared GPU: taken, given (handed over)', labelNames: ['agent', 'event'], registers: [reg] });
  const turnMs = new Gauge({ name: 'tb_agent_gpu_turn_seconds', help: "Seconds each agent taking GPU turns spent in its engine's wake-ups (acquire), hand-overs (release), waiting for the turn (wait) and holding it (held)", labelNames: ['agent', 'phase'], registers: [reg] });
  const rate = new Gauge({ name: 'tb_tokens_per_second', help: 'Tokens sampled and trained per second over the last 60 s', labelNames: ['kind'], registers: [reg] });

  return async (_req, res, next) => {
    try {
      const [m, counts, live, stats] = await Promise.all([
        readMetrics(ctx.redis, ctx.names),
        queueCounts(ctx.redis, ctx.names),
        ctx.registry.agents.live(),
        readAgentStats(ctx.redis, ctx.names),
      ]);
      snapshot = m;
      for (const g of [queue, rss, gpu, rate, turns, turnMs]) g.reset();
      for (const c of counts)
        for (const state of ['waiting', 'active', 'delayed', 'failed', 'completed'] as const)
          queue.set({ queue: c.queue, state }, state === 'waiting' ? c.waiting + c.prioritized : c[state]);
      alive.set(live.length);
      const liveIds = new Set(live.map((a) => a.agent_id));
      for (const s of stats.values()) {
        if (!liveIds.has(s.agent_id)) continue;
        const labels = { agent: s.agent_id, engine: s.engine, device: s.device };
        if (s.engine_rss_bytes !== null) rss.set(labels, s.engine_rss_bytes);
        if (s.gpu_memory_bytes !== null) gpu.set(labels, s.gpu_memory_bytes);
        const t = s.gpu_turns;
        if (t) {
          turns.set({ agent: s.agent_id, event: 'taken' }, t.taken);
          turns.set({ agent: s.agent_id, event: 'given' }, t.given);
          for (const phase of ['acquire', 'release', 'wait', 'held'] as const) turnMs.set({ agent: s.agent_id, phase }, t[`${phase}_ms`] / 1000);
        }
      }
      for (const kind of ['sampled', 'trained'] as const) {
        rate.set({ kind }, m.tokens[kind].perSecond);
      }
      res.setHeader('content-type', reg.contentType);
      res.send(await reg.metrics());
    } catch (e) {
      next(e);
    }
  };
}
