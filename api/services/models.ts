import type { Request } from 'express';
import { invalid } from '../../queues/contract/errors.js';
import { encodeRequestId } from '../../queues/contract/futures.js';
import { jobIds, resourceIds, shortHash } from '../../queues/contract/names.js';
import type { CheckpointRecord } from '../../queues/registry/checkpoints.js';
import type { ModelRecord } from '../../queues/registry/models.js';
import type { CreateModelJob, LoraConfig, TrainJob } from '../../queues/contract/schemas.js';
import { tenantOf } from '../auth.js';
import type { ApiContext } from '../context.js';
import { ensureRoom } from '../quotas.js';
import { issueFuture, requireSession } from '../tenants.js';
import { checkpointView, loadableCheckpoint } from './checkpoints.js';

/**
 * Training models (training runs): placement on an agent, creation (empty, or from a checkpoint),
 * the holders of copied weights, and their REST view.
 */

const frozen = (baseModel: string) =>
  invalid(`base model '${baseModel}' is frozen here (a teacher or reference); it can be sampled but not trained`);

/** Refuses every optimizer but AdamW (`optimizer_config` of create_model and create_training_client_from_state). */
export function assertAdamW(optimizer: { type: string } | null | undefined): void {
  if (optimizer && optimizer.type !== 'adamw')
    throw invalid(`optimizer '${optimizer.type}' is not supported by this server; supported: adamw (Dimuon's definition is not public, see docs/losses.md)`);
}

/**
 * Places a new model on a live agent serving its base model (deterministically, so a retried
 * create lands on the same agent), records it and opens its ordering gate. Idempotent.
 */
export async function placeModel(
  ctx: ApiContext,
  m: { modelId: string; sessionId: string; baseModel: string; lora: LoraConfig; tenant: string },
): Promise<ModelRecord> {
  const { model, trainers } = await ctx.registry.agents.resolveBaseModel(m.baseModel);
  // Only agents that train this model (an actor), never a sampling-only one (vLLM, frozen roles).
  if (trainers.length === 0) throw frozen(m.baseModel);
  const sorted = [...trainers].sort((a, b) => a.agent_id.localeCompare(b.agent_id));
  const agent = sorted[parseInt(shortHash(m.modelId, 8), 16) % sorted.length]!;
  const rec = await ctx.registry.models.putIfAbsent({
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
    orphaned_at: null,
  }, ctx.config.retentionS);
  await ctx.registry.models.index(rec, ctx.config.retentionS);
  await ctx.gate.open(m.modelId);
  return rec;
}

/** Queues a job on the model's training queue outside the seq_id order; returns the future's request_id. */
async function enqueue(ctx: ApiContext, req: Request, model: ModelRecord, jobId: string, job: TrainJob): Promise<string> {
  const requestId = await issueFuture(ctx, req, encodeRequestId({ queue: model.train_queue, jobId }));
  await ctx.queues.addTrain(model.train_queue, jobId, job);
  return requestId;
}

const createJob = (rec: ModelRecord): CreateModelJob => ({ op: 'create_model', model_id: rec.model_id, base_model: rec.base_model, lora: rec.lora });

/** create_model: a LoRA model `<session_id>:train:<model_seq_id>` on a trainable base model (its seq 0). */
export async function createModel(
  ctx: ApiContext,
  req: Request,
  body: { session_id: string; model_seq_id: number; base_model: string; lora: LoraConfig; optimizer_config?: { type: string } | null | undefined },
): Promise<{ request_id: string; model_id: string }> {
  assertAdamW(body.optimizer_config);
  await requireSession(ctx, req, body.session_id);
  const { model } = await ctx.registry.agents.resolveBaseModel(body.base_model);
  if (!model.trainable) throw frozen(body.base_model);
  if (body.lora.rank > model.lora_max_rank)
    throw invalid(`LoRA rank ${body.lora.rank} exceeds the largest rank served for '${body.base_model}' (${model.lora_max_rank})`);
  const modelId = resourceIds.model(body.session_id, body.model_seq_id);
  await ensureRoom(ctx, req, 'models', async () => (await ctx.registry.models.get(modelId)) !== null);
  const rec = await placeModel(ctx, { modelId, sessionId: body.session_id, baseModel: model.name, lora: body.lora, tenant: tenantOf(req) });
  return { request_id: await enqueue(ctx, req, rec, jobIds.createModel(modelId), createJob(rec)), model_id: modelId };
}

/**
 * create_training_client_from_state[_with_optimizer]: one load_weights request without a model_id
 * creates model `<session_id>:train:<model_seq_id>` with the checkpoint's base and LoRA config
 * (its seq 0) and loads the checkpoint into it. Both jobs go onto the agent's queue in order; the
 * load's job is the future.
 */
export async function createModelFromCheckpoint(
  ctx: ApiContext,
  req: Request,
  body: { session_id: string; model_seq_id: number; path: string; optimizer: boolean; base_model?: string | null | undefined; optimizer_config?: { type: string } | null | undefined },
): Promise<{ request_id: string; model_id: string }> {
  await requireSession(ctx, req, body.session_id);
  assertAdamW(body.optimizer_config);
  const c = await loadableCheckpoint(ctx, req, body.path);
  if (body.base_model) {
    const { model } = await ctx.registry.agents.resolveBaseModel(body.base_model);
    if (model.name !== c.base_model) throw invalid(`checkpoint ${body.path} is of base model ${c.base_model}, not ${body.base_model}`);
  }
  const modelId = resourceIds.model(body.session_id, body.model_seq_id);
  await ensureRoom(ctx, req, 'models', async () => (await ctx.registry.models.get(modelId)) !== null);
  const rec = await placeModel(ctx, { modelId, sessionId: body.session_id, baseModel: c.base_model, lora: c.lora, tenant: tenantOf(req) });
  await ctx.queues.addTrain(rec.train_queue, jobIds.createModel(modelId), createJob(rec));
  const load: TrainJob = { op: 'load_weights', model_id: modelId, seq_id: 0, tinker_path: c.tinker_path, dir: c.dir, optimizer: body.optimizer };
  return { request_id: await enqueue(ctx, req, rec, jobIds.loadOnCreate(modelId), load), model_id: modelId };
}

/** unload_model carries no seq_id: it runs after whatever the model's queue already holds. */
export async function unloadModel(ctx: ApiContext, req: Request, model: ModelRecord): Promise<{ request_id: string; model_id: string }> {
  const request_id = await enqueue(ctx, req, model, jobIds.unload(model.model_id), { op: 'unload_model', model_id: model.model_id });
  return { request_id, model_id: model.model_id };
}

/** The REST view of training runs (models), with their newest checkpoints: a fixed number of round trips. */
export async function trainingRuns(ctx: ApiContext, models: ModelRecord[]) {
  const ids = models.map((m) => m.model_id);
  const [last, ckpts] = await Promise.all([ctx.registry.models.lastRequests(ids), ctx.registry.checkpoints.ofModels(ids)]);
  return models.map((m, i) => {
    const newest = (t: CheckpointRecord['checkpoint_type']) => ckpts[i]!.find((c) => c.checkpoint_type === t);
    const training = newest('training');
    const sampler = newest('sampler');
    return {
      training_run_id: m.model_id,
      base_model: m.base_model,
      model_owner: 'local',
      is_lora: true,
      corrupted: false,
      lora_rank: m.lora.rank,
      last_request_time: last[i] ?? m.created_at,
      last_checkpoint: training ? checkpointView(training) : null,
      last_sampler_checkpoint: sampler ? checkpointView(sampler) : null,
      user_metadata: null,
    };
  });
}
