import { Router } from 'express';
import { z } from 'zod';
import { BrokerError } from '../../queues/errors.js';
import type { ModelRecord } from '../../queues/registry.js';
import { checkpointView, deleteCheckpoint } from '../checkpoints.js';
import type { ApiContext } from '../context.js';
import { CheckpointTtlBody, FinishSessionBody, parseBody, WeightsInfoBody } from '../http-schemas.js';
import { formatTinkerPath } from '../paths.js';

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
    const { models, total } = await ctx.registry.listModels(page.offset, page.limit);
    const last = await ctx.registry.modelLastRequest(models.map((m) => m.model_id));
    res.json({
      training_runs: await Promise.all(models.map((m, i) => trainingRun(m, last[i] ?? null))),
      cursor: { offset: page.offset, limit: page.limit, total_count: total },
    });
  });

  r.get('/training_runs/:id', async (req, res) => {
    const m = await ctx.registry.requireModel(req.params.id);
    res.json(await trainingRun(m, (await ctx.registry.modelLastRequest([m.model_id]))[0] ?? null));
  });

  r.get('/training_runs/:id/checkpoints', async (req, res) => {
    const m = await ctx.registry.requireModel(req.params.id);
    res.json({ checkpoints: (await ctx.registry.listModelCheckpoints(m.model_id)).map(checkpointView) });
  });

  /** The checkpoint named by a REST path (`weights/<name>` or `sampler_weights/<name>`), or a 404. */
  async function checkpointAt(modelId: string, kind: string, name: string) {
    if (kind !== 'weights' && kind !== 'sampler_weights')
      throw new BrokerError('INVALID_REQUEST', `checkpoint ids are weights/<name> or sampler_weights/<name>, got ${kind}/${name}`);
    const tinkerPath = formatTinkerPath({ modelId, kind, name });
    const c = await ctx.registry.getCheckpoint(tinkerPath);
    if (!c) throw new BrokerError('NOT_FOUND', `checkpoint ${tinkerPath} does not exist`);
    return c;
  }

  r.delete('/training_runs/:id/checkpoints/:kind/:name', async (req, res) => {
    await deleteCheckpoint(ctx, await checkpointAt(req.params.id, req.params.kind, req.params.name));
    res.json({});
  });

  r.put('/training_runs/:id/checkpoints/:kind/:name/ttl', async (req, res) => {
    const c = await checkpointAt(req.params.id, req.params.kind, req.params.name);
    const body = parseBody(CheckpointTtlBody, req.body, 'checkpoint ttl');
    const expires = body.ttl_seconds === null ? null : new Date(Date.now() + body.ttl_seconds * 1000).toISOString();
    await ctx.registry.putCheckpoint({ ...c, expires_at: expires });
    res.json({});
  });

  for (const [method, value] of [['post', true], ['delete', false]] as const) {
    r[method]('/training_runs/:id/checkpoints/:kind/:name/publish', async (req, res) => {
      const c = await checkpointAt(req.params.id, req.params.kind, req.params.name);
      if (c.public === value)
        throw new BrokerError('CONFLICT', `checkpoint ${c.tinker_path} is already ${value ? 'public' : 'private'}`);
      await ctx.registry.putCheckpoint({ ...c, public: value });
      res.json({});
    });
  }

  r.get('/checkpoints', async (req, res) => {
    const page = parseBody(Page.extend({ limit: z.coerce.number().int().min(1).max(1000).default(100) }), req.query, 'checkpoints');
    const { checkpoints, total } = await ctx.registry.listAllCheckpoints(page.offset, page.limit);
    res.json({ checkpoints: checkpoints.map(checkpointView), cursor: { offset: page.offset, limit: page.limit, total_count: total } });
  });

  r.post('/weights_info', async (req, res) => {
    const body = parseBody(WeightsInfoBody, req.body, 'weights_info');
    const c = await ctx.registry.getCheckpoint(body.tinker_path);
    if (!c) throw new BrokerError('NOT_FOUND', `checkpoint ${body.tinker_path} does not exist (never saved, deleted or expired)`);
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
    res.json({ sessions: await ctx.registry.listSessions(page.offset, page.limit) });
  });

  r.get('/sessions/:id', async (req, res) => {
    if (!(await ctx.registry.sessionExists(req.params.id))) throw new BrokerError('NOT_FOUND', `unknown session '${req.params.id}'`);
    res.json(await ctx.registry.sessionMembers(req.params.id));
  });

  // ServiceClient.close(): the first finish reason wins; later heartbeats get 410.
  r.post('/sessions/:id/finish', async (req, res) => {
    const body = parseBody(FinishSessionBody, req.body, 'finish session');
    if (!(await ctx.registry.sessionExists(req.params.id))) throw new BrokerError('NOT_FOUND', `unknown session '${req.params.id}'`);
    res.json(
      await ctx.registry.finishSession(req.params.id, { reason: body.reason, detail: body.detail ?? null, finished_at: new Date().toISOString() }),
    );
  });

  r.put('/sessions/:id/project', async (req, res) => {
    if (!(await ctx.registry.sessionExists(req.params.id))) throw new BrokerError('NOT_FOUND', `unknown session '${req.params.id}'`);
    res.json({});
  });

  return r;
}
