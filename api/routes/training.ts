import express, { Router, type Request, type RequestHandler } from 'express';
import { BrokerError } from '../../queues/errors.js';
import { encodeRequestId } from '../../queues/futures.js';
import { jobIds } from '../../queues/names.js';
import type { ModelRecord } from '../../queues/registry.js';
import type { Datum, TrainJob } from '../../queues/schemas.js';
import type { ApiContext } from '../context.js';
import { tenantOf } from '../auth.js';
import { issueFuture, ownsModel, requireCheckpoint, requireModel, requireSession } from '../tenants.js';
import { parseRecipient } from '../../queues/age.js';
import type { z } from 'zod';
import { AgentGone } from '../../queues/gate.js';
import type { CheckpointRecord } from '../../queues/registry.js';
import type { LoraConfig } from '../../queues/schemas.js';
import { placeModel } from './models.js';
import {
  CreateViaLoadBody,
  LoadWeightsBody,
  ModelIdBody,
  OptimStepBody,
  parseBody,
  SaveWeightsBody,
  SaveWeightsExternalBody,
  SaveWeightsForSamplerBody,
} from '../http-schemas.js';
import { formatTinkerPath, parseTinkerPath, storageDirFor } from '../paths.js';
import { attachStability } from '../stability.js';
import { decodeForwardBackwardRequest } from '../wire/proto.js';

/** forward_backward (also forward), optim_step, save_weights_for_sampler: ordered per model. */

const RL = ['target_tokens', 'logprobs', 'advantages'];
const CLIP = ['clip_low_threshold', 'clip_high_threshold'];

/**
 * Loss functions and the `loss_fn_inputs` each takes (definitions and sources: docs/losses.md).
 * stable_reinforce's sampler logprobs come from the server's stability records, not the datum:
 * a datum's `logprobs` is accepted and not used.
 */
export const LOSS_INPUTS: Record<string, { required: string[]; optional: string[] }> = {
  cross_entropy: { required: ['target_tokens'], optional: ['weights'] },
  importance_sampling: { required: RL, optional: [] },
  ppo: { required: RL, optional: CLIP },
  cispo: { required: RL, optional: CLIP },
  dro: { required: RL, optional: [] },
  gspo: { required: RL, optional: ['sequence_ratio_mask', ...CLIP] },
  stable_reinforce: { required: ['target_tokens', 'advantages'], optional: ['logprobs', 'clip_high_threshold'] },
};

const invalid = (m: string) => new BrokerError('INVALID_REQUEST', m);

/** Widest 2-D loss input (N, K) accepted (top-K distillation targets and weights). */
export const MAX_TARGET_K = 128;

/** A model's context length (records placed before it was stored: from the agents' registry). */
async function contextLength(ctx: ApiContext, model: ModelRecord): Promise<number> {
  if (model.max_context_length !== null) return model.max_context_length;
  return (await ctx.registry.resolveBaseModel(model.base_model)).model.max_context_length;
}

/** Checks a batch against the loss and the model before it is queued; the engine re-checks. */
export function validateBatch(lossFn: string, data: Datum[], vocabSize: number): void {
  const spec = LOSS_INPUTS[lossFn];
  if (!spec) throw invalid(`unknown loss_fn '${lossFn}'; supported: ${Object.keys(LOSS_INPUTS).join(', ')}`);
  if (data.length === 0) throw invalid('forward_backward needs at least one datum');
  data.forEach((d, i) => {
    const n = d.tokens.length;
    if (n === 0) throw invalid(`data[${i}]: model_input is empty`);
    for (const t of d.tokens)
      if (t < 0 || t >= vocabSize) throw invalid(`data[${i}]: model_input token id ${t} is outside the vocabulary [0, ${vocabSize})`);
    for (const k of spec.required) if (!d.loss_fn_inputs[k]) throw invalid(`data[${i}]: loss_fn '${lossFn}' needs loss_fn_inputs.${k}`);
    for (const k of Object.keys(d.loss_fn_inputs))
      if (!spec.required.includes(k) && !spec.optional.includes(k))
        throw invalid(`data[${i}]: loss_fn_inputs.${k} is not an input of '${lossFn}' (expected ${[...spec.required, ...spec.optional].join(', ')})`);
    const target = d.loss_fn_inputs.target_tokens!;
    for (const [k, t] of Object.entries(d.loss_fn_inputs)) {
      if (t.shape[0] !== n)
        throw invalid(`data[${i}]: loss_fn_inputs.${k} has shape [${t.shape.join(', ')}] but model_input has ${n} tokens`);
      if (t.data.some((v) => !Number.isFinite(v))) throw invalid(`data[${i}]: loss_fn_inputs.${k} contains NaN or infinite values`);
    }
    if (target.shape.length > 2) throw invalid(`data[${i}]: target_tokens must be (N,) or (N, K), got [${target.shape.join(', ')}]`);
    if (lossFn !== 'cross_entropy' && target.shape.length !== 1) throw invalid(`data[${i}]: '${lossFn}' needs 1-D target_tokens`);
    for (const t of target.data)
      if (!Number.isInteger(t) || t < 0 || t >= vocabSize) throw invalid(`data[${i}]: target token id ${t} is outside the vocabulary [0, ${vocabSize})`);
    for (const [k, t] of Object.entries(d.loss_fn_inputs)) {
      if (k !== 'target_tokens' && t.shape.join(',') !== target.shape.join(','))
        throw invalid(`data[${i}]: loss_fn_inputs.${k} has shape [${t.shape.join(', ')}], target_tokens has [${target.shape.join(', ')}]`);
    }
  });
}

/**
 * Any other POST under /api/v1 is an endpoint this server lacks. If it carries a model_id and a
 * seq_id, the SDK has used up that seq_id: skip it, so the model's next op is not stuck.
 */
export function unknownEndpointGuard(ctx: ApiContext): RequestHandler {
  return async (req, _res, next) => {
    await guardSeq(ctx, req, req.body?.model_id, req.body?.seq_id, async () => {
      throw new BrokerError('NOT_FOUND', `no such endpoint: ${req.method} ${req.path} (not supported by this server)`);
    }).catch(next);
  };
}

/**
 * Runs a route's checks. The SDK has used up a `seq_id` even when the server refuses the request
 * (it does not resend a 400), so once model_id and seq_id are known a refusal skips that seq_id
 * in the gate: later ops of the model must not wait behind it. Only the model's own tenant can
 * use up its seq_ids.
 */
async function guardSeq<T>(ctx: ApiContext, req: Request, modelId: unknown, seqId: unknown, fn: () => Promise<T>): Promise<T> {
  try {
    return await fn();
  } catch (e) {
    if (
      typeof modelId === 'string' &&
      typeof seqId === 'number' &&
      Number.isInteger(seqId) &&
      seqId >= 1 &&
      (await ctx.gate.isOpen(modelId)) &&
      (await ownsModel(ctx, req, modelId))
    )
      await ctx.gate.skip(modelId, seqId, jobIds.train(modelId, seqId));
    throw e;
  }
}

/**
 * The fast path of every ordered training op: one script admits it, records its future's owner and,
 * when it is in order, queues it (queues/gate.ts); the model was read by the route (2 round trips).
 * A model that is lost, or whose agent is gone, gets a future that fails with the reason (an HTTP
 * 5xx would be retried by the SDK for minutes).
 */
async function submitTrainOp(ctx: ApiContext, req: Request, model: ModelRecord, seqId: number, job: TrainJob): Promise<string> {
  const jobId = jobIds.train(model.model_id, seqId);
  const requestId = encodeRequestId({ queue: model.train_queue, jobId });
  let lost = model.lost_reason;
  if (!lost) {
    try {
      // The future is recorded only once the gate took the op: a refused request leaves nothing in Redis.
      await guardSeq(ctx, req, model.model_id, seqId, () =>
        ctx.gate.submit(model.model_id, seqId, model.train_queue, jobId, job, {
          tenant: tenantOf(req),
          ownerTtlS: ctx.config.retentionS * 2,
          agentId: model.agent_id,
        }),
      );
      return requestId;
    } catch (e) {
      if (!(e instanceof AgentGone)) throw e;
      lost = `its worker agent ${model.agent_id} is not running; load it from a saved checkpoint`;
      await ctx.registry.markModelLost(model.model_id, lost);
    }
  }
  if ((await ctx.gate.skip(model.model_id, seqId, jobId)) === 'admitted')
    await ctx.registry.putFailedFuture(jobId, { op: job.op, category: 'server', message: `model ${model.model_id} is unavailable: ${lost}` }, ctx.config.retentionS);
  return issueFuture(ctx, req, requestId);
}

/** The training checkpoint at `path`, checked for loading into a model of `base` with `lora`. */
async function loadableCheckpoint(
  ctx: ApiContext,
  req: Request,
  path: string,
  target?: { model_id: string; base_model: string; lora: LoraConfig },
): Promise<CheckpointRecord> {
  const tp = parseTinkerPath(path);
  if (tp.kind !== 'weights') throw invalid(`${path} is not a training checkpoint (weights/<name>); load one saved with save_state`);
  const c = await requireCheckpoint(ctx, req, path, 'read');
  if (target) {
    if (c.base_model !== target.base_model)
      throw invalid(`checkpoint ${path} is of base model ${c.base_model}; model ${target.model_id} is of ${target.base_model}`);
    const key = (l: LoraConfig) => `rank ${l.rank}, train_attn ${l.train_attn}, train_mlp ${l.train_mlp}, train_unembed ${l.train_unembed}`;
    if (key(c.lora) !== key(target.lora)) throw invalid(`checkpoint ${path} has LoRA (${key(c.lora)}); model ${target.model_id} has (${key(target.lora)})`);
  }
  return c;
}

/**
 * create_training_client_from_state[_with_optimizer]: one load_weights request without a model_id
 * creates model `<session_id>:train:<model_seq_id>` with the checkpoint's base and LoRA config
 * (its seq 0) and loads the checkpoint into it. Both jobs go onto the agent's queue in order; the
 * load's job is the future.
 */
async function createViaLoad(ctx: ApiContext, req: Request, body: z.output<typeof CreateViaLoadBody>): Promise<{ request_id: string; model_id: string }> {
  await requireSession(ctx, req, body.session_id, ': call create_session first');
  if (body.optimizer_config && body.optimizer_config.type !== 'adamw')
    throw invalid(`optimizer '${body.optimizer_config.type}' is not supported by this server; supported: adamw (Dimuon's definition is not public, see docs/losses.md)`);
  const c = await loadableCheckpoint(ctx, req, body.path);
  if (body.base_model) {
    const { model } = await ctx.registry.resolveBaseModel(body.base_model);
    if (model.name !== c.base_model) throw invalid(`checkpoint ${body.path} is of base model ${c.base_model}, not ${body.base_model}`);
  }
  const modelId = `${body.session_id}:train:${body.model_seq_id}`;
  const rec = await placeModel(ctx, { modelId, sessionId: body.session_id, baseModel: c.base_model, lora: c.lora, tenant: tenantOf(req) });
  const jobId = jobIds.createModel(modelId);
  await ctx.queues.add(rec.train_queue, jobId, { op: 'create_model', model_id: modelId, base_model: rec.base_model, lora: rec.lora });
  const loadId = jobIds.loadOnCreate(modelId);
  const requestId = await issueFuture(ctx, req, encodeRequestId({ queue: rec.train_queue, jobId: loadId }));
  await ctx.queues.add(rec.train_queue, loadId, {
    op: 'load_weights',
    model_id: modelId,
    seq_id: 0,
    tinker_path: c.tinker_path,
    dir: c.dir,
    optimizer: body.optimizer,
  });
  return { request_id: requestId, model_id: modelId };
}

export function trainingRoutes(ctx: ApiContext): Router {
  const r = Router();

  // The body is read only up to its bound (express answers past it before buffering the rest).
  r.post('/forward_backward', express.raw({ type: () => true, limit: `${ctx.config.maxTrainBodyMb ?? 64}mb` }), async (req, res) => {
    if (!Buffer.isBuffer(req.body) || req.body.length === 0) throw invalid('forward_backward needs a protobuf ForwardBackwardRequest body');
    const fb = decodeForwardBackwardRequest(req.body);
    if (!fb.model_id) throw invalid('forward_backward: model_id is required');
    if (fb.seq_id < 1) throw invalid(`forward_backward: seq_id must be ≥ 1, got ${fb.seq_id}`);
    const model = await requireModel(ctx, req, fb.model_id);
    const data = await guardSeq(ctx, req, fb.model_id, fb.seq_id, async () => {
      // The datums are decoded only now, under the model's bounds: nothing is allocated past them.
      const data = fb.data({ maxTokens: await contextLength(ctx, model), vocabSize: model.vocab_size, maxK: MAX_TARGET_K });
      validateBatch(fb.loss_fn, data, model.vocab_size);
      if (fb.loss_fn === 'dro' && typeof fb.loss_fn_config.beta !== 'number') throw invalid("loss_fn 'dro' needs loss_fn_config.beta");
      if (fb.loss_fn === 'stable_reinforce') await attachStability(ctx, model, data, fb.provenance);
      return data;
    });
    const { data: _lazy, provenance: _spans, ...rest } = fb;
    const requestId = await submitTrainOp(ctx, req, model, fb.seq_id, { op: 'forward_backward', ...rest, data });
    res.json({ request_id: requestId, model_id: fb.model_id });
  });

  r.post('/optim_step', async (req, res) => {
    const body = await guardSeq(ctx, req, req.body?.model_id, req.body?.seq_id, async () => parseBody(OptimStepBody, req.body, 'optim_step'));
    const model = await requireModel(ctx, req, body.model_id);
    const adam = (body.adam_params ?? body.optim_params)!;
    const requestId = await submitTrainOp(ctx, req, model, body.seq_id, { op: 'optim_step', model_id: body.model_id, seq_id: body.seq_id, adam });
    res.json({ request_id: requestId, model_id: body.model_id });
  });

  r.post('/save_weights_for_sampler', async (req, res) => {
    const body = await guardSeq(ctx, req, req.body?.model_id, req.body?.seq_id, async () =>
      parseBody(SaveWeightsForSamplerBody, req.body, 'save_weights_for_sampler'),
    );
    const model = await requireModel(ctx, req, body.model_id);
    const named = (body.path ?? null) !== null;
    const tp = { modelId: model.model_id, kind: 'sampler_weights' as const, name: named ? body.path! : `ephemeral-${body.seq_id}` };
    const requestId = await submitTrainOp(ctx, req, model, body.seq_id, {
      op: 'save_weights_for_sampler',
      model_id: model.model_id,
      seq_id: body.seq_id,
      tinker_path: formatTinkerPath(tp),
      dir: storageDirFor(ctx.config.storageDir, tp),
      sampling_session_id: named ? null : `${model.session_id}:sample:${body.sampling_session_seq_id}`,
      kind: body.kind,
      ttl_seconds: body.ttl_seconds ?? null,
      user_metadata: body.user_metadata ?? null,
    });
    res.json({ request_id: requestId, model_id: body.model_id });
  });

  // save_state / save_weights: adapter and optimizer as tinker://<model_id>/weights/<name>.
  r.post('/save_weights', async (req, res) => {
    const body = await guardSeq(ctx, req, req.body?.model_id, req.body?.seq_id, async () => parseBody(SaveWeightsBody, req.body, 'save_weights'));
    const model = await requireModel(ctx, req, body.model_id);
    const tp = { modelId: model.model_id, kind: 'weights' as const, name: body.path };
    const tinkerPath = formatTinkerPath(tp);
    await guardSeq(ctx, req, body.model_id, body.seq_id, async () => {
      if (!body.overwrite && (await ctx.registry.getCheckpoint(tinkerPath)))
        throw invalid(`checkpoint ${tinkerPath} already exists; pass overwrite=True to replace it`);
    });
    const requestId = await submitTrainOp(ctx, req, model, body.seq_id, {
      op: 'save_weights',
      model_id: model.model_id,
      seq_id: body.seq_id,
      tinker_path: tinkerPath,
      dir: storageDirFor(ctx.config.storageDir, tp),
      overwrite: body.overwrite,
      ttl_seconds: body.ttl_seconds ?? null,
      user_metadata: body.user_metadata ?? null,
    });
    res.json({ request_id: requestId, model_id: body.model_id });
  });

  // load_state / load_state_with_optimizer, and the load behind create_training_client_from_state.
  r.post('/load_weights', async (req, res) => {
    if (req.body && req.body.model_id === undefined && req.body.session_id !== undefined) {
      res.json(await createViaLoad(ctx, req, parseBody(CreateViaLoadBody, req.body, 'load_weights')));
      return;
    }
    const body = await guardSeq(ctx, req, req.body?.model_id, req.body?.seq_id, async () => parseBody(LoadWeightsBody, req.body, 'load_weights'));
    const model = await requireModel(ctx, req, body.model_id);
    const ckpt = await guardSeq(ctx, req, body.model_id, body.seq_id, () => loadableCheckpoint(ctx, req, body.path, model));
    const requestId = await submitTrainOp(ctx, req, model, body.seq_id, {
      op: 'load_weights',
      model_id: model.model_id,
      seq_id: body.seq_id,
      tinker_path: ckpt.tinker_path,
      dir: ckpt.dir,
      optimizer: body.optimizer,
    });
    res.json({ request_id: requestId, model_id: body.model_id });
  });

  // save_weights_external: the adapter as plain (or age-encrypted) files, downloadable through signed URLs.
  r.post('/save_weights_external', async (req, res) => {
    const body = await guardSeq(ctx, req, req.body?.model_id, req.body?.seq_id, async () => {
      const b = parseBody(SaveWeightsExternalBody, req.body, 'save_weights_external');
      for (const rcp of b.age_encryption_recipients ?? []) {
        try {
          parseRecipient(rcp);
        } catch (e) {
          throw invalid(`age_encryption_recipients: ${(e as Error).message}`);
        }
      }
      return b;
    });
    const model = await requireModel(ctx, req, body.model_id);
    const tp = { modelId: model.model_id, kind: 'external_weights' as const, name: body.path };
    const tinkerPath = formatTinkerPath(tp);
    await guardSeq(ctx, req, body.model_id, body.seq_id, async () => {
      if (await ctx.registry.getCheckpoint(tinkerPath)) throw invalid(`external weights ${tinkerPath} already exist; save under a new name`);
    });
    const requestId = await submitTrainOp(ctx, req, model, body.seq_id, {
      op: 'save_weights_external',
      model_id: model.model_id,
      seq_id: body.seq_id,
      tinker_path: tinkerPath,
      dir: storageDirFor(ctx.config.storageDir, tp),
      ttl_seconds: body.ttl_seconds ?? null,
      age_recipients: body.age_encryption_recipients ?? [],
    });
    res.json({ request_id: requestId, model_id: body.model_id });
  });

  // unload_model carries no seq_id: it runs after whatever the model's queue already holds.
  r.post('/unload_model', async (req, res) => {
    const body = parseBody(ModelIdBody, req.body, 'unload_model');
    const model = await requireModel(ctx, req, body.model_id);
    const jobId = jobIds.unload(model.model_id);
    const requestId = await issueFuture(ctx, req, encodeRequestId({ queue: model.train_queue, jobId }));
    await ctx.queues.add(model.train_queue, jobId, { op: 'unload_model', model_id: model.model_id });
    res.json({ request_id: requestId, model_id: model.model_id });
  });

  return r;
}
