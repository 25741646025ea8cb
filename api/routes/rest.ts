import { randomUUID } from 'node:crypto';
import { cp } from 'node:fs/promises';
import { Router, type Request } from 'express';
import { z } from 'zod';
import { BrokerError } from '../../queues/errors.js';
import type { ModelRecord } from '../../queues/registry.js';
import { checkpointView, deleteCheckpoint } from '../checkpoints.js';
import { tenantOf } from '../auth.js';
import type { ApiContext } from '../context.js';
import { requireCheckpoint, requireModel, requireSession } from '../tenants.js';
import { CheckpointTtlBody, CopyWeightsBody, FinishSessionBody, parseBody, SessionSearchBody, WeightsInfoBody } from '../http-schemas.js';
import { CHECKPOINT_KINDS, formatTinkerPath, parseTinkerPath, storageDirFor, type CheckpointKind } from '../paths.js';
import { signedUrls } from '../file-urls.js';

/** The REST side of the SDK (RestClient, CLI): training runs, checkpoints, sessions, weights_info. */

const Page = z.object({
  limit: z.coerce.number().int().min(1).max(1000).default(20),
  offset: z.coerce.number().int().min(0).default(0),
});

export function restRoutes(ctx: ApiContext): Router {
  const r = Router();

  async function trainingRun(m: ModelRecord, lastRequest: string | null) {
    const ckpts = await ctx.registry.listModelCheckpoints(m.model_id);
    const last = (t: string) => ckpts.find((c) => c.checkpoint_type === t);
    const training = last('training');
    const sampler = last('sampler');
    return {
      training_run_id: m.model_id,
      base_model: m.base_model,
      model_owner: 'local',
      is_lora: true,
      corrupted: false,
      lora_rank: m.lora.rank,
      last_request_time: lastRequest ?? m.created_at,
      last_checkpoint: training ? checkpointView(training) : null,
      last_sampler_checkpoint: sampler ? checkpointView(sampler) : null,
      user_metadata: null,
    };
  }

  r.get('/training_runs', async (req, res) => {
    const page = parseBody(Page, req.query, 'training_runs');
    const { models, total } = await ctx.registry.listModels(tenantOf(req), page.offset, page.limit);
    const last = await ctx.registry.modelLastRequest(models.map((m) => m.model_id));
    res.json({
      training_runs: await Promise.all(models.map((m, i) => trainingRun(m, last[i] ?? null))),
      cursor: { offset: page.offset, limit: page.limit, total_count: total },
    });
  });

  r.get('/training_runs/:id', async (req, res) => {
    const m = await requireModel(ctx, req, req.params.id);
    res.json(await trainingRun(m, (await ctx.registry.modelLastRequest([m.model_id]))[0] ?? null));
  });

  r.get('/training_runs/:id/checkpoints', async (req, res) => {
    const m = await requireModel(ctx, req, req.params.id);
    res.json({ checkpoints: (await ctx.registry.listModelCheckpoints(m.model_id)).map(checkpointView) });
  });

  /** The checkpoint named by a REST path (`<kind>/<name>`), or a 404 (also for another tenant's, unless published and only read). */
  async function checkpointAt(req: Request, access: 'read' | 'write') {
    const { id: modelId, kind, name } = req.params as { id: string; kind: string; name: string };
    if (!(CHECKPOINT_KINDS as readonly string[]).includes(kind))
      throw new BrokerError('INVALID_REQUEST', `checkpoint ids are ${CHECKPOINT_KINDS.map((k) => `${k}/<name>`).join(', ')}; got ${kind}/${name}`);
    return requireCheckpoint(ctx, req, formatTinkerPath({ modelId, kind: kind as CheckpointKind, name }), access);
  }

  r.delete('/training_runs/:id/checkpoints/:kind/:name', async (req, res) => {
    await deleteCheckpoint(ctx, await checkpointAt(req, 'write'));
    res.json({});
  });

  r.put('/training_runs/:id/checkpoints/:kind/:name/ttl', async (req, res) => {
    const c = await checkpointAt(req, 'write');
    const body = parseBody(CheckpointTtlBody, req.body, 'checkpoint ttl');
    const expires = body.ttl_seconds === null ? null : new Date(Date.now() + body.ttl_seconds * 1000).toISOString();
    await ctx.registry.putCheckpoint({ ...c, expires_at: expires });
    res.json({});
  });

  for (const [method, value] of [['post', true], ['delete', false]] as const) {
    r[method]('/training_runs/:id/checkpoints/:kind/:name/publish', async (req, res) => {
      const c = await checkpointAt(req, 'write');
      if (c.public === value)
        throw new BrokerError('CONFLICT', `checkpoint ${c.tinker_path} is already ${value ? 'public' : 'private'}`);
      await ctx.registry.putCheckpoint({ ...c, public: value });
      res.json({});
    });
  }

  r.get('/training_runs/:id/checkpoints/:kind/:name/external_weights_urls', async (req, res) => {
    const c = await checkpointAt(req, 'read');
    if (c.checkpoint_type !== 'external')
      throw new BrokerError('INVALID_REQUEST', `${c.tinker_path} is not an external weights checkpoint (save it with save_weights_external)`);
    res.json(await signedUrls(ctx, req, c.tinker_path, c.dir));
  });

  // copy_weights: a copy of a checkpoint held by a new, untrainable training run.
  r.post('/copy_weights', async (req, res) => {
    const body = parseBody(CopyWeightsBody, req.body, 'copy_weights');
    const idem = req.header('x-idempotency-key');
    const tenant = tenantOf(req);
    const idemKey = idem ? `${ctx.names.prefix}:idem:copy:${tenant}:${idem}` : null;
    if (idemKey) {
      const prev = await ctx.redis.get(idemKey);
      if (prev) return void res.json({ tinker_path: prev });
    }
    const src = parseTinkerPath(body.source_path);
    const c = await requireCheckpoint(ctx, req, body.source_path, 'read');
    let sessionId = body.session_id ?? null;
    if (sessionId) await requireSession(ctx, req, sessionId);
    if (!sessionId) {
      sessionId = randomUUID();
      await ctx.registry.createSession(sessionId, tenant, { tags: ['copy_weights'] }, ctx.config.retentionS);
    }
    const holderId = `${sessionId}:train:${body.model_seq_id ?? 0}`;
    const holder: ModelRecord = await ctx.registry.putModelIfAbsent({
      model_id: holderId,
      session_id: sessionId,
      base_model: c.base_model,
      arch: 'copy',
      vocab_size: 0,
      lora: c.lora,
      agent_id: '',
      train_queue: '',
      created_at: new Date().toISOString(),
      lost_reason: `it holds copied weights (copy_weights) and cannot be trained; use create_training_client_from_state`,
      tenant,
      max_context_length: null,
    });
    await ctx.registry.indexModel(holder);
    const tp = { modelId: holderId, kind: src.kind, name: src.name };
    const dir = storageDirFor(ctx.config.storageDir, tp);
    await cp(c.dir, dir, { recursive: true, force: true });
    const now = Date.now();
    const tinkerPath = formatTinkerPath(tp);
    await ctx.registry.putCheckpoint({
      ...c,
      tinker_path: tinkerPath,
      model_id: holderId,
      dir,
      time: new Date(now).toISOString(),
      expires_at: body.ttl_seconds ? new Date(now + body.ttl_seconds * 1000).toISOString() : null,
      public: false,
      ephemeral: false,
      tenant,
    });
    if (idemKey) await ctx.redis.set(idemKey, tinkerPath, 'EX', 86_400);
    res.json({ tinker_path: tinkerPath });
  });

  r.get('/checkpoints', async (req, res) => {
    const page = parseBody(Page.extend({ limit: z.coerce.number().int().min(1).max(1000).default(100) }), req.query, 'checkpoints');
    const { checkpoints, total } = await ctx.registry.listAllCheckpoints(tenantOf(req), page.offset, page.limit);
    res.json({ checkpoints: checkpoints.map(checkpointView), cursor: { offset: page.offset, limit: page.limit, total_count: total } });
  });

  r.post('/weights_info', async (req, res) => {
    const body = parseBody(WeightsInfoBody, req.body, 'weights_info');
    const c = await requireCheckpoint(ctx, req, body.tinker_path, 'read');
    res.json({
      base_model: c.base_model,
      is_lora: true,
      lora_rank: c.lora.rank,
      train_unembed: c.lora.train_unembed,
      train_mlp: c.lora.train_mlp,
      train_attn: c.lora.train_attn,
    });
  });

  r.get('/sessions', async (req, res) => {
    const page = parseBody(Page, req.query, 'sessions');
    res.json({ sessions: await ctx.registry.listSessions(tenantOf(req), page.offset, page.limit) });
  });

  r.get('/sessions/:id', async (req, res) => {
    await requireSession(ctx, req, req.params.id);
    res.json(await ctx.registry.sessionMembers(req.params.id));
  });

  // ServiceClient.close(): the first finish reason wins; later heartbeats get 410.
  r.post('/sessions/:id/finish', async (req, res) => {
    const body = parseBody(FinishSessionBody, req.body, 'finish session');
    await requireSession(ctx, req, req.params.id);
    res.json(
      await ctx.registry.finishSession(req.params.id, { reason: body.reason, detail: body.detail ?? null, finished_at: new Date().toISOString() }),
    );
  });

  r.post('/sessions/search', async (req, res) => {
    const body = parseBody(SessionSearchBody, req.body, 'sessions/search');
    const ids = await ctx.registry.listSessions(tenantOf(req), 0, 10_000);
    const out = [];
    for (const id of ids) {
      if (body.session_id && id !== body.session_id) continue;
      const info = await ctx.registry.sessionInfo(id);
      if (!info) continue;
      const meta = (info.user_metadata ?? {}) as Record<string, string>;
      if (Object.entries(body.user_metadata).some(([k, v]) => meta[k] !== v)) continue;
      const finished = await ctx.registry.sessionFinish(id);
      const statuses = body.statuses?.map((s) => s.type);
      if (statuses && !statuses.includes(finished ? 'client_finished' : 'active')) continue;
      const members = await ctx.registry.sessionMembers(id);
      let ckpts = 0;
      for (const m of members.training_run_ids) ckpts += (await ctx.registry.listModelCheckpoints(m)).length;
      out.push({
        session_id: id,
        created_at: String(info.created_at),
        owner: 'local',
        project_id: String(info.project_id ?? 'default'),
        status: finished ? { type: 'client_finished', reason: finished.reason, detail: finished.detail, finished_at: finished.finished_at } : { type: 'active' },
        checkpoints_count: ckpts,
        user_metadata: meta,
      });
      if (out.length >= body.limit) break;
    }
    res.json({ sessions: out, next_cursor: null });
  });

  // No trace recorder runs here: the export reports that, and the SDK raises it to the caller.
  r.get('/sessions/:id/trace_export', async (req, res) => {
    await requireSession(ctx, req, req.params.id);
    res.json({ status: 'failed', error: 'session trace export is not available on this server (tinker-broker records no traces)' });
  });

  // The audit log: checkpoint creations, from the checkpoint registry.
  r.get('/audit', async (req, res) => {
    const { checkpoints } = await ctx.registry.listAllCheckpoints(tenantOf(req), 0, 1000);
    res.json({
      entries: checkpoints.map((c) => ({ timestamp: c.time, event: 'checkpoint_created', event_details: { checkpoint_type: c.checkpoint_type }, model_id: c.model_id, tinker_path: c.tinker_path })),
    });
  });

  // Nothing is billed on your own hardware: usage events are empty; storage is measured.
  r.get('/billing/usage/events', (_req, res) => {
    res.json({ data: [], sessions: {} });
  });
  r.get('/billing/usage/checkpoints/current', async (req, res) => {
    const { checkpoints } = await ctx.registry.listAllCheckpoints(tenantOf(req), 0, 100_000);
    const bytes = checkpoints.reduce((a, c) => a + (c.size_bytes ?? 0), 0);
    res.json({
      effective_rate_usd_per_gigabyte_month: null,
      data: [{ checkpoint_count: checkpoints.length, size_bytes: bytes, size_gigabytes: bytes / 1e9, estimated_monthly_cost_usd: null }],
    });
  });

  r.put('/sessions/:id/project', async (req, res) => {
    await requireSession(ctx, req, req.params.id);
    res.json({});
  });

  return r;
}
