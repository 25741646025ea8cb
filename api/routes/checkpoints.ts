import { Router } from 'express';
import { tenantOf } from '../auth.js';
import type { ApiContext } from '../context.js';
import { signedUrls } from '../file-urls.js';
import { CheckpointTtlBody, CopyWeightsBody, PageQuery, parseBody, WeightsInfoBody } from '../http-schemas.js';
import { invalid } from '../../queues/contract/errors.js';
import {
  checkpointAt,
  checkpointView,
  copyCheckpoint,
  deleteCheckpoint,
  setCheckpointPublic,
  setCheckpointTtl,
} from '../services/checkpoints.js';
import { requireCheckpoint, requireModel } from '../tenants.js';

/** Checkpoints on the REST side (RestClient, CLI): list, delete, TTL, publish, download URLs, copy, weights_info, audit, storage use (api/services/checkpoints.ts). */
export function checkpointRoutes(ctx: ApiContext): Router {
  const r = Router();
  const one = '/training_runs/:id/checkpoints/:kind/:name';

  r.get('/training_runs/:id/checkpoints', async (req, res) => {
    const m = await requireModel(ctx, req, req.params.id);
    res.json({ checkpoints: (await ctx.registry.checkpoints.ofModel(m.model_id)).map(checkpointView) });
  });

  r.delete(one, async (req, res) => {
    await deleteCheckpoint(ctx, await checkpointAt(ctx, req, 'write'));
    res.json({});
  });

  r.put(`${one}/ttl`, async (req, res) => {
    const c = await checkpointAt(ctx, req, 'write');
    await setCheckpointTtl(ctx, c, parseBody(CheckpointTtlBody, req.body, 'checkpoint ttl').ttl_seconds);
    res.json({});
  });

  for (const [method, value] of [['post', true], ['delete', false]] as const) {
    r[method](`${one}/publish`, async (req, res) => {
      await setCheckpointPublic(ctx, await checkpointAt(ctx, req, 'write'), value);
      res.json({});
    });
  }

  r.get(`${one}/external_weights_urls`, async (req, res) => {
    const c = await checkpointAt(ctx, req, 'read');
    if (c.checkpoint_type !== 'external') throw invalid(`${c.tinker_path} is not an external weights checkpoint (save it with save_weights_external)`);
    res.json(await signedUrls(ctx, req, c.tinker_path, c.dir));
  });

  // copy_weights: a copy of a checkpoint held by a new, untrainable training run.
  r.post('/copy_weights', async (req, res) => {
    const body = parseBody(CopyWeightsBody, req.body, 'copy_weights');
    res.json({ tinker_path: await copyCheckpoint(ctx, req, body, req.header('x-idempotency-key')) });
  });

  r.get('/checkpoints', async (req, res) => {
    const page = parseBody(PageQuery(100), req.query, 'checkpoints');
    const { checkpoints, total } = await ctx.registry.checkpoints.list(tenantOf(req), page.offset, page.limit);
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

  // The audit log: checkpoint creations, from the checkpoint registry.
  r.get('/audit', async (req, res) => {
    const { checkpoints } = await ctx.registry.checkpoints.list(tenantOf(req), 0, 1000);
    res.json({
      entries: checkpoints.map((c) => ({ timestamp: c.time, event: 'checkpoint_created', event_details: { checkpoint_type: c.checkpoint_type }, model_id: c.model_id, tinker_path: c.tinker_path })),
    });
  });

  // Nothing is billed on your own hardware; storage is measured.
  r.get('/billing/usage/checkpoints/current', async (req, res) => {
    const { checkpoints } = await ctx.registry.checkpoints.list(tenantOf(req), 0, 100_000);
    const bytes = checkpoints.reduce((a, c) => a + (c.size_bytes ?? 0), 0);
    res.json({
      effective_rate_usd_per_gigabyte_month: null,
      data: [{ checkpoint_count: checkpoints.length, size_bytes: bytes, size_gigabytes: bytes / 1e9, estimated_monthly_cost_usd: null }],
    });
  });

  return r;
}
