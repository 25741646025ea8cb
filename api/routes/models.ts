import { Router } from 'express';
import { BrokerError } from '../../queues/errors.js';
import { tenantOf } from '../auth.js';
import { encodeRequestId } from '../../queues/futures.js';
import { jobIds, shortHash } from '../../queues/names.js';
import type { ModelRecord } from '../../queues/registry.js';
import type { CreateModelJob, LoraConfig } from '../../queues/schemas.js';
import type { ApiContext } from '../context.js';
import { issueFuture, requireModel, requireSession } from '../tenants.js';
import { CreateModelBody, ModelIdBody, parseBody } from '../http-schemas.js';

/**
 * Places a new model on a live agent serving its base model (deterministically, so a retried
 * create lands on the same agent), records it and opens its ordering gate. Idempotent.
 */
export async function placeModel(
  ctx: ApiContext,
  m: { modelId: string; sessionId: string; baseModel: string; lora: LoraConfig; tenant: string },
): Promise<ModelRecord> {
  const { model, trainers } = await ctx.registry.resolveBaseModel(m.baseModel);
  // Only agents that train this model (an actor), never a sampling-only one (vLLM, frozen roles).
  if (trainers.length === 0) throw new BrokerError('INVALID_REQUEST', `base model '${m.baseModel}' is frozen here (a teacher or reference); it can be sampled but not trained`);
  const sorted = [...trainers].sort((a, b) => a.agent_id.localeCompare(b.agent_id));
  const agent = sorted[parseInt(shortHash(m.modelId, 8), 16) % sorted.length]!;
  const rec = await ctx.registry.putModelIfAbsent({
    model_id: m.modelId,
    session_id: m.sessionId,
    base_model: model.name,
    arch: model.arch,
    vocab_size: model.vocab_size,
    lora: m.lora,
    agent_id: agent.agent_id,
    train_queue: agent.train_queue,
    created_at: new Date().toISOString(),
    lost_reason: null,
    tenant: m.tenant,
    max_context_length: model.max_context_length,
  });
  await ctx.registry.indexModel(rec);
  await ctx.gate.open(m.modelId);
  return rec;
}

/** create_model (a future; the model's seq 0) and get_info. */
export function modelRoutes(ctx: ApiContext): Router {
  const r = Router();

  r.post('/create_model', async (req, res) => {
    const body = parseBody(CreateModelBody, req.body, 'create_model');
    if (!body.lora_config)
      throw new BrokerError('INVALID_REQUEST', 'full-weight training is not supported; pass lora_config (create_lora_training_client)');
    if (body.optimizer_config && body.optimizer_config.type !== 'adamw')
      throw new BrokerError('INVALID_REQUEST', `optimizer '${body.optimizer_config.type}' is not supported by this server; supported: adamw (Dimuon's definition is not public, see docs/losses.md)`);
    await requireSession(ctx, req, body.session_id, ': call create_session first');
    const { model } = await ctx.registry.resolveBaseModel(body.base_model);
    if (!model.trainable)
      throw new BrokerError('INVALID_REQUEST', `base model '${body.base_model}' is frozen here (a teacher or reference); it can be sampled but not trained`);
    if (body.lora_config.rank > model.lora_max_rank)
      throw new BrokerError('INVALID_REQUEST', `LoRA rank ${body.lora_config.rank} exceeds the largest rank served for '${body.base_model}' (${model.lora_max_rank})`);
    const modelId = `${body.session_id}:train:${body.model_seq_id}`;
    const lora = {
      rank: body.lora_config.rank,
      seed: body.lora_config.seed ?? null,
      train_unembed: body.lora_config.train_unembed,
      train_mlp: body.lora_config.train_mlp,
      train_attn: body.lora_config.train_attn,
    };
    const rec = await placeModel(ctx, { modelId, sessionId: body.session_id, baseModel: model.name, lora, tenant: tenantOf(req) });
    const job: CreateModelJob = { op: 'create_model', model_id: modelId, base_model: rec.base_model, lora: rec.lora };
    const jobId = jobIds.createModel(modelId);
    const requestId = await issueFuture(ctx, req, encodeRequestId({ queue: rec.train_queue, jobId }));
    await ctx.queues.add(rec.train_queue, jobId, job);
    res.json({ request_id: requestId, model_id: modelId });
  });

  r.post('/get_info', async (req, res) => {
    const body = parseBody(ModelIdBody, req.body, 'get_info');
    const m = await requireModel(ctx, req, body.model_id);
    res.json({
      type: 'get_info',
      model_id: m.model_id,
      model_data: { arch: m.arch, model_name: m.base_model, tokenizer_id: m.base_model },
      is_lora: true,
      lora_rank: m.lora.rank,
      model_name: m.base_model,
    });
  });

  return r;
}
