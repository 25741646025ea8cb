import { Router } from 'express';
import { invalid } from '../../queues/contract/errors.js';
import { tenantOf } from '../auth.js';
import type { ApiContext } from '../context.js';
import { CreateModelBody, ModelIdBody, PageQuery, parseBody } from '../http-schemas.js';
import { createModel, trainingRuns, unloadModel } from '../services/models.js';
import { requireModel } from '../tenants.js';

/**
 * The tokenizer a client loads for a base model (`get_info`'s tokenizer_id): the one its agents
 * publish (the preset's `tokenizer`, a hub id or a directory), else the model's canonical name, its
 * directory on the agent (also when no agent serves it right now).
 */
export async function tokenizerOf(ctx: ApiContext, baseModel: string): Promise<string> {
  return (await ctx.registry.agents.servedModels()).get(baseModel)?.model.tokenizer ?? baseModel;
}

/** Training models: create_model (a future; the model's seq 0), get_info, unload_model, and the REST training runs (api/services/models.ts). */
export function modelRoutes(ctx: ApiContext): Router {
  const r = Router();

  r.post('/create_model', async (req, res) => {
    const body = parseBody(CreateModelBody, req.body, 'create_model');
    const l = body.lora_config;
    if (!l) throw invalid('full-weight training is not supported; pass lora_config (create_lora_training_client)');
    const lora = { rank: l.rank, seed: l.seed ?? null, train_unembed: l.train_unembed, train_mlp: l.train_mlp, train_attn: l.train_attn };
    res.json(await createModel(ctx, req, { ...body, lora }));
  });

  r.post('/get_info', async (req, res) => {
    const m = await requireModel(ctx, req, parseBody(ModelIdBody, req.body, 'get_info').model_id);
    res.json({
      type: 'get_info',
      model_id: m.model_id,
      model_data: { arch: m.arch, model_name: m.base_model, tokenizer_id: await tokenizerOf(ctx, m.base_model) },
      is_lora: true,
      lora_rank: m.lora.rank,
      model_name: m.base_model,
    });
  });

  r.post('/unload_model', async (req, res) => {
    const model = await requireModel(ctx, req, parseBody(ModelIdBody, req.body, 'unload_model').model_id);
    res.json(await unloadModel(ctx, req, model));
  });

  r.get('/training_runs', async (req, res) => {
    const page = parseBody(PageQuery(), req.query, 'training_runs');
    const { models, total } = await ctx.registry.models.list(tenantOf(req), page.offset, page.limit);
    res.json({ training_runs: await trainingRuns(ctx, models), cursor: { offset: page.offset, limit: page.limit, total_count: total } });
  });

  r.get('/training_runs/:id', async (req, res) => {
    res.json((await trainingRuns(ctx, [await requireModel(ctx, req, req.params.id)]))[0]);
  });

  return r;
}
