import { Job, Queue } from 'bullmq';
import { Redis } from 'ioredis';
import { decodeJobFailure, recordedFailure, type Failure } from '../queues/contract/errors.js';
import { decodeRequestId } from '../queues/contract/futures.js';
import { queueCounts } from '../queues/runtime/inspect.js';
import { readAgentStats, readMetrics } from '../queues/runtime/metrics.js';
import { Names } from '../queues/contract/names.js';
import { Outcomes } from '../queues/runtime/outcomes.js';
import { Registry } from '../queues/registry/index.js';
import type { ModelRecord } from '../queues/registry/models.js';
import type { ApiConfig } from '../queues/infra/config.js';
import { planPreset } from '../presets/plan.js';
import { loadPreset } from '../presets/schema.js';
import { table, UsageError, type CommandTable, type OptionSpec, type Parsed } from './cli.js';

/**
 * `status`, `agents`, `models`, `futures`: the state of a running deployment, read from its
 * Redis (the URL and key prefix of the preset, or REDIS_URL and TB_PREFIX), and the API's
 * /healthz. Every command takes --json for scripts.
 */
const DEFAULT_PRESET = 'presets/cpu/tiny.yaml';

const common: Record<string, OptionSpec> = {
  preset: { type: 'string', arg: 'FILE', default: DEFAULT_PRESET, help: "the deployment's preset (for its Redis URL, key prefix and API address)" },
  json: { type: 'boolean', help: 'print JSON instead of tables' },
};

const ENV_DETAILS = `Environment: REDIS_URL and TB_PREFIX override the preset's redis.url and redis.prefix;
TB_HOST and TB_PORT its api.host and api.port.`;

type Target = { redisUrl: string; prefix: string; apiUrl: string; redis: Redis; names: Names; registry: Registry };

async function connectTarget(p: Parsed): Promise<Target> {
  const file = p.values.preset as string;
  const { preset, dir } = loadPreset(file);
  let api: ApiConfig;
  try {
    // The preset under the environment, parsed as `start` parses it (queues/infra/config.ts).
    api = planPreset(preset, dir, file, { apiOnly: true, python: '', env: process.env }).api!;
  } catch (e) {
    throw new UsageError((e as Error).message);
  }
  const { redisUrl, prefix, host, port } = api;
  const apiUrl = `http://${host === '0.0.0.0' ? '127.0.0.1' : host}:${port}`;
  const redis = new Redis(redisUrl, { lazyConnect: true, maxRetriesPerRequest: 1, retryStrategy: () => null, connectTimeout: 2000 });
  redis.on('error', () => undefined);
  try {
    await redis.connect();
  } catch {
    redis.disconnect();
    throw new UsageError(`cannot reach Redis at ${redisUrl}; is the deployment running? (set REDIS_URL or --preset)`);
  }
  const names = new Names(prefix);
  return { redisUrl, prefix, apiUrl, redis, names, registry: new Registry(redis, names) };
}

/** A failure as `inspect future` prints it. */
const errorFields = (f: Failure) => ({ code: f.code, category: f.category, error: f.message });

async function withTarget(p: Parsed, fn: (t: Target) => Promise<void>): Promise<void> {
  const t = await connectTarget(p);
  try {
    await fn(t);
  } finally {
    t.redis.disconnect();
  }
}

const out = (...lines: string[]): void => {
  process.stdout.write(`${lines.join('\n')}\n`);
};
const mib = (b: number | null | undefined) => (b === null || b === undefined ? '-' : `${(b / 2 ** 20).toFixed(0)} MiB`);
const ago = (iso: string | null | undefined) => {
  if (!iso) return '-';
  const s = Math.max(0, Math.round((Date.now() - Date.parse(iso)) / 1000));
  return s < 120 ? `${s}s ago` : s < 7200 ? `${Math.round(s / 60)}m ago` : `${(s / 3600).toFixed(1)}h ago`;
};

async function agentRows(t: Target) {
  const all = await t.redis.hgetall(t.names.agents());
  const stats = await readAgentStats(t.redis, t.names);
  const live = new Set((await t.registry.agents.live()).map((a) => a.agent_id));
  return Object.values(all)
    .map((v) => JSON.parse(v) as { agent_id: string; engine: string; device: string; started_at: string; train_queue: string; models: { name: string; aliases: string[]; trainable: boolean }[] })
    .sort((a, b) => a.agent_id.localeCompare(b.agent_id))
    .map((a) => ({ ...a, alive: live.has(a.agent_id), stats: stats.get(a.agent_id) ?? null }));
}

/** Every tenant's listing of one kind (`<prefix>:tenant:<tenant>:<what>`), as [tenant, key]. */
async function tenantIndexes(t: Target, what: 'sessions' | 'models'): Promise<[string, string][]> {
  const out: [string, string][] = [];
  const head = `${t.prefix}:tenant:`;
  let cursor = '0';
  do {
    const [next, keys] = await t.redis.scan(cursor, 'MATCH', `${head}*:${what}`, 'COUNT', 500);
    cursor = next;
    for (const k of keys) out.push([k.slice(head.length, k.length - what.length - 1), k]);
  } while (cursor !== '0');
  return out;
}

/** Counts of training models and sessions over every tenant (API key). */
async function totals(t: Target): Promise<{ models: number; sessions: number; tenants: number }> {
  const [m, s] = await Promise.all([tenantIndexes(t, 'models'), tenantIndexes(t, 'sessions')]);
  const count = async (list: [string, string][]) => (await Promise.all(list.map(([, k]) => t.redis.zcard(k)))).reduce((a, b) => a + b, 0);
  return { models: await count(m), sessions: await count(s), tenants: new Set([...m, ...s].map(([x]) => x)).size };
}

/** The newest training models of every tenant. */
async function newestModels(t: Target, limit: number): Promise<{ models: ModelRecord[]; total: number }> {
  const idx = await tenantIndexes(t, 'models');
  const scored: [string, number][] = [];
  let total = 0;
  for (const [, k] of idx) {
    total += await t.redis.zcard(k);
    const flat = await t.redis.zrevrange(k, 0, limit - 1, 'WITHSCORES');
    for (let i = 0; i < flat.length; i += 2) scored.push([flat[i]!, Number(flat[i + 1])]);
  }
  scored.sort((a, b) => b[1] - a[1]);
  const models = (await Promise.all(scored.slice(0, limit).map(([id]) => t.registry.models.get(id)))).filter((m): m is ModelRecord => m !== null);
  return { models, total };
}

async function apiHealth(url: string): Promise<{ reachable: boolean; status: string; detail?: string }> {
  try {
    const r = await fetch(`${url}/healthz`, { signal: AbortSignal.timeout(3000) });
    const j = (await r.json()) as { status: string; detail?: string };
    return { reachable: true, status: j.status, ...(j.detail ? { detail: j.detail } : {}) };
  } catch (e) {
    return { reachable: false, status: 'unreachable', detail: String((e as Error).cause ?? (e as Error).message) };
  }
}

async function status(p: Parsed): Promise<void> {
  await withTarget(p, async (t) => {
    const [health, agents, queues, tot, m] = await Promise.all([
      apiHealth(t.apiUrl),
      agentRows(t),
      queueCounts(t.redis, t.names),
      totals(t),
      readMetrics(t.redis, t.names),
    ]);
    const ops = [...new Set(m.jobs.map((j) => j.op))].sort().map((op) => {
      const count = (st: string) => m.jobs.filter((j) => j.op === op && j.status === st).reduce((a, j) => a + j.count, 0);
      const mean = (phase: 'queue_wait' | 'engine' | 'total') => {
        const h = m.latency[phase].get(op);
        return h && h.count ? h.sumMs / h.count : null;
      };
      return { op, ok: count('ok'), user_errors: count('user_error'), server_errors: count('server_error'), mean_ms: { queue_wait: mean('queue_wait'), engine: mean('engine'), total: mean('total') } };
    });
    const { models, sessions, tenants } = tot;
    if (p.values.json) {
      out(
        JSON.stringify({ redis: { url: t.redisUrl, prefix: t.prefix }, api: { url: t.apiUrl, ...health }, agents, queues, training_models: models, sessions, tenants, ops, tokens: m.tokens }, null, 2),
      );
      return;
    }
    out(`redis    ${t.redisUrl} prefix '${t.prefix}' (reachable)`);
    out(`api      ${t.apiUrl}/api/v1 ${health.status}${health.detail ? ` (${health.detail})` : ''}`);
    const alive = agents.filter((a) => a.alive);
    out(`agents   ${alive.length} alive${alive.length ? `: ${alive.map((a) => `${a.agent_id} (${a.engine}, ${a.device})`).join(', ')}` : ''}${agents.length > alive.length ? `; ${agents.length - alive.length} not answering` : ''}`);
    out(`models   ${models} training model${models === 1 ? '' : 's'}, ${sessions} session${sessions === 1 ? '' : 's'}, ${tenants} API key${tenants === 1 ? '' : 's'} in use`);
    out(`tokens   sampled ${m.tokens.sampled.total} (${m.tokens.sampled.perSecond.toFixed(1)}/s over the last minute), trained ${m.tokens.trained.total} (${m.tokens.trained.perSecond.toFixed(1)}/s)`);
    out('');
    if (queues.length === 0) out('queues   none yet');
    else
      out(
        table(
          ['QUEUE', 'WAITING', 'ACTIVE', 'DELAYED', 'COMPLETED', 'FAILED'],
          queues.map((q) => [q.queue, q.waiting + q.prioritized, q.active, q.delayed, q.completed, q.failed]),
        ),
      );
    if (ops.length) {
      const ms = (v: number | null) => (v === null ? '-' : v < 10_000 ? `${Math.round(v)} ms` : `${(v / 1000).toFixed(1)} s`);
      out('');
      out(
        table(
          ['OP', 'OK', 'USER ERRORS', 'SERVER ERRORS', 'MEAN WAIT', 'MEAN ENGINE', 'MEAN TOTAL'],
          ops.map((o) => [o.op, o.ok, o.user_errors, o.server_errors, ms(o.mean_ms.queue_wait), ms(o.mean_ms.engine), ms(o.mean_ms.total)]),
        ),
      );
    }
  });
}

async function agents(p: Parsed): Promise<void> {
  await withTarget(p, async (t) => {
    const rows = await agentRows(t);
    if (p.values.json) return out(JSON.stringify(rows, null, 2));
    if (rows.length === 0) return out(`no agent is registered under prefix '${t.prefix}'`);
    out(
      table(
        ['AGENT', 'ALIVE', 'ENGINE', 'DEVICE', 'MODELS', 'ENGINE RSS', 'GPU MEMORY', 'GPU TURNS', 'STARTED'],
        rows.map((a) => [
          a.agent_id,
          a.alive ? 'yes' : 'no',
          a.engine,
          a.device,
          a.models.map((m) => `${m.aliases[0] ?? m.name}${m.trainable ? '' : ' (frozen)'}`).join(', '),
          mib(a.stats?.engine_rss_bytes),
          mib(a.stats?.gpu_memory_bytes),
          // Agents taking GPU turns (workers/gpu-turns.ts): turns taken / handed over, and whether it holds the GPU now.
          a.stats?.gpu_turns ? `${a.stats.gpu_turns.taken}/${a.stats.gpu_turns.given}${a.stats.gpu_turns.holding ? ' (holds)' : ''}` : '-',
          ago(a.started_at),
        ]),
      ),
    );
  });
}

async function models(p: Parsed): Promise<void> {
  await withTarget(p, async (t) => {
    const served = [...(await t.registry.agents.servedModels()).values()];
    const limit = Number(p.values.limit);
    if (!Number.isInteger(limit) || limit <= 0) throw new UsageError(`--limit must be a positive whole number, got '${p.values.limit}'`);
    const { models: trained, total } = await newestModels(t, limit);
    const last = await t.registry.models.lastRequests(trained.map((m) => m.model_id));
    if (p.values.json) {
      out(
        JSON.stringify(
          {
            base_models: served.map((e) => ({ ...e.model, agents: e.agents.map((a) => a.agent_id), trainers: e.trainers.map((a) => a.agent_id) })),
            training_models: trained.map((m, i) => ({ ...m, last_request: last[i] ?? null })),
            total_training_models: total,
          },
          null,
          2,
        ),
      );
      return;
    }
    out('base models (served by live agents):');
    if (served.length === 0) out('  none: no agent is running');
    else
      out(
        table(
          ['NAME', 'ALIASES', 'TRAINABLE', 'CONTEXT', 'AGENTS'],
          served.map((e) => [e.model.name, e.model.aliases.join(', ') || '-', e.model.trainable ? 'yes' : 'no', e.model.max_context_length, e.agents.map((a) => a.agent_id).join(', ')]),
        ),
      );
    out('', `training models (${trained.length} newest of ${total}):`);
    if (trained.length === 0) out('  none yet');
    else
      out(
        table(
          ['MODEL ID', 'BASE MODEL', 'LORA RANK', 'AGENT', 'TENANT', 'CREATED', 'LAST REQUEST', 'STATE'],
          trained.map((m, i) => [
            m.model_id,
            m.base_model,
            m.lora.rank,
            m.agent_id,
            m.tenant.slice(0, 8) || '-',
            ago(m.created_at),
            ago(last[i]),
            m.lost_reason ? `lost: ${m.lost_reason}` : 'loaded',
          ]),
        ),
      );
  });
}

async function futures(p: Parsed): Promise<void> {
  const id = p.positionals[0]!;
  const ref = decodeRequestId(id);
  if (!ref) throw new UsageError(`'${id}' is not a request id; request ids look like train-<agent>/t-<hash>-<seq> or sample-<hash>-<engine>/s-<hash>-<seq>`);
  await withTarget(p, async (t) => {
    const q = new Queue(ref.queue, { connection: t.redis, prefix: t.names.bull });
    try {
      const job = await Job.fromId(q, ref.jobId);
      let info: Record<string, unknown>;
      if (!job) {
        const failed = await t.registry.futures.getFailed(ref.jobId);
        const held = await t.redis.hget(`${t.prefix}:gate:held-index`, ref.jobId);
        info = failed
          ? { request_id: id, state: 'failed', op: failed.op, ...errorFields(recordedFailure(failed)), note: 'refused before it reached a queue' }
          : held !== null
            ? { request_id: id, state: 'held', note: `waiting in the ordering gate of model ${held} for a lower seq_id` }
            : { request_id: id, state: 'unknown', note: 'no such job: never submitted, or removed after the future retention' };
      } else {
        const state = await job.getState();
        const data = job.data as { op: string; model_id?: string; seq_id?: number };
        const failure = job.failedReason ? decodeJobFailure(job.failedReason) : null;
        const ms = (a?: number, b?: number) => (a && b ? b - a : null);
        info = {
          request_id: id,
          state,
          op: data.op,
          ...(data.model_id ? { model_id: data.model_id } : {}),
          ...(data.seq_id !== undefined ? { seq_id: data.seq_id } : {}),
          queued_at: new Date(job.timestamp).toISOString(),
          started_at: job.processedOn ? new Date(job.processedOn).toISOString() : null,
          finished_at: job.finishedOn ? new Date(job.finishedOn).toISOString() : null,
          queue_wait_ms: ms(job.timestamp, job.processedOn),
          engine_ms: ms(job.processedOn, job.finishedOn),
          total_ms: ms(job.timestamp, job.finishedOn),
          ...(failure ? errorFields(failure) : {}),
          ...(job.returnvalue && typeof job.returnvalue === 'object' ? { result_fields: Object.keys(job.returnvalue as object) } : {}),
        };
        // A training op's outcome is recorded apart from the job (docs/reliability.md): it is the truth.
        const o = await new Outcomes(t.redis, t.names, 1).get(ref.jobId);
        if (o) {
          info.outcome = o.state;
          if (o.state === 'failed') Object.assign(info, errorFields(recordedFailure(o)));
          if (o.state === 'done' && o.result && typeof o.result === 'object') info.result_fields = Object.keys(o.result);
        }
      }
      if (p.values.json) return out(JSON.stringify(info, null, 2));
      const w = Math.max(...Object.keys(info).map((k) => k.length)) + 2;
      for (const [k, v] of Object.entries(info)) if (v !== null) out(`${k.padEnd(w)}${Array.isArray(v) ? v.join(', ') : String(v)}`);
    } finally {
      await q.close();
    }
  });
}

export const inspectCommands: CommandTable = {
  status: { summary: 'the API, agents, training models, queue depths and per-op counts and latencies of a running deployment', options: { ...common }, details: ENV_DETAILS, run: status },
  agents: { summary: 'the worker agents: engine, device, models, engine memory, liveness', options: { ...common }, details: ENV_DETAILS, run: agents },
  models: {
    summary: 'base models served and training models created (of every API key)',
    options: { ...common, limit: { type: 'string', arg: 'N', default: '50', help: 'most training models listed, newest first' } },
    details: ENV_DETAILS,
    run: models,
  },
  futures: {
    summary: "one future (a request id from the SDK or the server's log): state, timings, error",
    args: 'REQUEST_ID',
    minArgs: 1,
    maxArgs: 1,
    options: { ...common },
    details: ENV_DETAILS,
    run: futures,
  },
};
