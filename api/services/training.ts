import type { Request } from 'express';
import { CUSTOM_LOSS_FN } from '../../queues/contract/custom-loss.js';
import { customLossForJob } from './custom-loss.js';
import { invalid } from '../../queues/contract/errors.js';
import { checkLossConfig, lossEntry, lossInputs } from '../../queues/contract/losses.js';
import { jobIds } from '../../queues/contract/names.js';
import type { ModelRecord } from '../../queues/registry/models.js';
import type { Datum, ForwardBackwardJob } from '../../queues/contract/schemas.js';
import type { ApiContext } from '../context.js';
import { ownsModel } from '../tenants.js';
import { attachStability } from '../stability.js';
import type { DecodedForwardBackward } from '../wire/proto.js';

/**
 * forward_backward (also forward): the checks of a batch against its loss and model, before it is
 * queued. Every rule about a loss (its inputs, target shapes, config keys, whether it needs
 * provenance) comes from the loss catalogue (queues/contract/losses.json; definitions and sources:
 * docs/losses.md): no loss is named here. A loss with `provenance` gets its server inputs from the
 * server's stability records (api/stability.ts).
 */

/** Widest 2-D loss input (N, K) accepted (top-K distillation targets and weights). */
export const MAX_TARGET_K = 128;

/** A model's context length (records placed before it was stored: from the agents' registry). */
async function contextLength(ctx: ApiContext, model: ModelRecord): Promise<number> {
  if (model.max_context_length !== null) return model.max_context_length;
  return (await ctx.registry.agents.resolveBaseModel(model.base_model)).model.max_context_length;
}

/** Checks a batch against the loss and the model before it is queued; the engine re-checks. */
export function validateBatch(lossFn: string, data: Datum[], vocabSize: number): void {
  const spec = lossInputs(lossFn);
  const { topk } = lossEntry(lossFn);
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
    if (!topk && target.shape.length !== 1) throw invalid(`data[${i}]: '${lossFn}' needs 1-D target_tokens`);
    for (const t of target.data)
      if (!Number.isInteger(t) || t < 0 || t >= vocabSize) throw invalid(`data[${i}]: target token id ${t} is outside the vocabulary [0, ${vocabSize})`);
    for (const [k, t] of Object.entries(d.loss_fn_inputs)) {
      if (k !== 'target_tokens' && t.shape.join(',') !== target.shape.join(','))
        throw invalid(`data[${i}]: loss_fn_inputs.${k} has shape [${t.shape.join(', ')}], target_tokens has [${target.shape.join(', ')}]`);
    }
  });
}

/** The forward_backward job of a decoded request: its datums decoded under the model's bounds and checked. */
export async function forwardBackwardJob(ctx: ApiContext, req: Request, fb: DecodedForwardBackward, model: ModelRecord): Promise<ForwardBackwardJob> {
  // The datums are decoded only now, under the model's bounds: nothing is allocated past them.
  const data = fb.data({ maxTokens: await contextLength(ctx, model), vocabSize: model.vocab_size, maxK: MAX_TARGET_K });
  if (fb.loss_fn === CUSTOM_LOSS_FN) {
    // A stored custom loss (api/services/custom-loss.ts): its declared inputs, not the catalogue, say what a datum needs.
    if (data.length === 0) throw invalid('forward_backward needs at least one datum');
    const custom = await customLossForJob(ctx, req, fb.loss_fn_config, data, model);
    custom.data.forEach((d, i) => {
      if (d.tokens.length === 0) throw invalid(`data[${i}]: model_input is empty`);
      for (const t of d.tokens) if (t < 0 || t >= model.vocab_size) throw invalid(`data[${i}]: model_input token id ${t} is outside the vocabulary [0, ${model.vocab_size})`);
      for (const t of d.loss_fn_inputs.target_tokens!.data)
        if (!Number.isInteger(t) || t < 0 || t >= model.vocab_size) throw invalid(`data[${i}]: target token id ${t} is outside the vocabulary [0, ${model.vocab_size})`);
      for (const [k, t] of Object.entries(d.loss_fn_inputs))
        if (t.data.some((v) => !Number.isFinite(v))) throw invalid(`data[${i}]: loss_fn_inputs.${k} contains NaN or infinite values`);
    });
    const { data: _lazy, provenance: _spans, ...rest } = fb;
    return { op: 'forward_backward', ...rest, data: custom.data, custom_loss: custom.spec };
  }
  validateBatch(fb.loss_fn, data, model.vocab_size);
  checkLossConfig(fb.loss_fn, fb.loss_fn_config);
  if (lossEntry(fb.loss_fn).provenance) await attachStability(ctx, model, fb.loss_fn, data, fb.provenance);
  const { data: _lazy, provenance: _spans, ...rest } = fb;
  return { op: 'forward_backward', ...rest, data };
}

/**
 * The SDK has used up a `seq_id` even when the server refuses the request (it does not resend a
 * 400), so a refusal once model_id and seq_id are known skips that seq_id in the model's gate:
 * later ops of the model must not wait behind it. Only the model's own tenant can use up its seq_ids.
 */
export async function useUpSeqId(ctx: ApiContext, req: Request, modelId: unknown, seqId: unknown): Promise<void> {
  if (typeof modelId !== 'string' || typeof seqId !== 'number' || !Number.isInteger(seqId) || seqId < 1) return;
  if ((await ctx.gate.isOpen(modelId)) && (await ownsModel(ctx, req, modelId))) await ctx.gate.skip(modelId, seqId, jobIds.train(modelId, seqId));
}
