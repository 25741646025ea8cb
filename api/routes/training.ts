import express, { Router, type Request, type RequestHandler } from 'express';
import type { z } from 'zod';
import { parseRecipient } from '../../queues/infra/age.js';
import { assertSaveAllowed } from '../../queues/runtime/checkpoints.js';
import { BrokerError, invalid, modelUnavailable } from '../../queues/contract/errors.js';
import { AgentGone, ModelGone, ModelLost, ModelMoved } from '../../queues/runtime/gate.js';
import { encodeRequestId } from '../../queues/contract/futures.js';
import { jobIds, resourceIds } from '../../queues/contract/names.js';
import type { ModelRecord } from '../../queues/registry/models.js';
import type { TrainJob } from '../../queues/contract/schemas.js';
import type { ApiContext } from '../context.js';
import { ensureRoom } from '../quotas.js';
import type { DirectRoutes } from '../direct.js';
import {
  CreateViaLoadBody,
  LoadWeightsBody,
  OptimStepBody,
  parseBody,
  SaveWeightsBody,
  SaveWeightsExternalBody,
  SaveWeightsForSamplerBody,
} from '../http-schemas.js';
import { formatTinkerPath, storageDirFor } from '../paths.js';
import { loadableCheckpoint } from '../services/checkpoints.js';
import { createModelFromCheckpoint } from '../services/models.js';
import { forwardBackwardJob, useUpSeqId } from '../services/training.js';
import { tenantOf } from '../auth.js';
import { issueFuture, requireModel, requireModelForOp } from '../tenants.js';
import { decodeForwardBackwardRequest, PROTOBUF_CONTENT_TYPE } from '../wire/proto.js';

/** The ordered training ops of a model (forward_backward, optim_step, saves and loads), through the gate in seq_id order. */

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

/** Runs a route's checks; a refusal uses up the request's seq_id (`useUpSeqId`). */
async function guardSeq<T>(ctx: ApiContext, req: Request, modelId: unknown, seqId: unknown, fn: () => Promise<T>): Promise<T> {
  try {
    return await fn();
  } catch (e) {
    await useUpSeqId(ctx, req, modelId, seqId);
    throw e;
  }
}

/**
 * The fast path of every ordered training op: one script admits it, records its future's owner and,
 * when it is in order, queues it (queues/runtime/gate.ts); the model was read by the route, usually from this
 * process's copy (ModelRegistry.placed: one round trip in all), and the script checks that it still
 * exists and is not lost. A model that is lost, or whose agent is gone, gets a future that fails with
 * the reason (an HTTP 5xx would be retried by the SDK for minutes).
 */
async function submitTrainOp(ctx: ApiContext, req: Request, model: ModelRecord, seqId: number, job: TrainJob, moves = 0): Promise<string> {
  const jobId = jobIds.train(model.model_id, seqId);
  const requestId = encodeRequestId({ queue: model.train_queue, jobId });
  let lost = model.lost_reason;
  if (!lost) {
    try {
      // The future is recorded only once the gate took the op: a refused request leaves nothing in Redis.
      await ctx.gate.submit(model.model_id, seqId, model.train_queue, jobId, job, {
        tenant: tenantOf(req),
        ownerTtlS: ctx.config.retentionS * 2,
        agentId: model.agent_id,
        checkModel: true,
      });
      return requestId;
    } catch (e) {
      if (e instanceof ModelGone || e instanceof ModelLost || e instanceof ModelMoved) ctx.registry.models.forget(model.model_id);
      // Another agent adopted the model since this copy was read (workers/agent/adoption.ts): again, on its queue.
      if (e instanceof ModelMoved && moves < 3) return submitTrainOp(ctx, req, await requireModelForOp(ctx, req, model.model_id), seqId, job, moves + 1);
      // The model expired since this process's copy was read: what the route answers without a copy.
      if (e instanceof ModelGone) await requireModel(ctx, req, model.model_id);
      // A refusal uses up the seq_id (as guardSeq does). An agent gone or a model lost is not a
      // refusal: the op gets a failed future below, and the skip that records it must be the first one for this seq_id.
      if (!(e instanceof AgentGone || e instanceof ModelLost)) {
        await useUpSeqId(ctx, req, model.model_id, seqId);
        throw e;
      }
      if (e instanceof ModelLost) lost = e.reason;
      else {
        lost = `its worker agent ${model.agent_id} is not running; load it from a saved checkpoint`;
        await ctx.registry.models.markLost(model.model_id, lost);
      }
    }
  }
  if ((await ctx.gate.skip(model.model_id, seqId, jobId)) === 'admitted')
    await ctx.registry.futures.putFailed(jobId, { op: job.op, category: 'server', code: 'UNAVAILABLE', message: modelUnavailable(model.model_id, lost) }, ctx.config.retentionS);
  return issueFuture(ctx, req, requestId);
}

/**
 * One ordered training op, in the order every route of this file keeps: parse the request, find
 * the model, build its job (the op's own checks), submit it through the gate. A refusal once
 * model_id and seq_id are known skips that seq_id (guardSeq).
 */
function orderedOp<B extends { model_id: string; seq_id: number }>(
  ctx: ApiContext,
  parse: (req: Request) => B,
  job: (body: B, model: ModelRecord, req: Request) => TrainJob | Promise<TrainJob>,
): RequestHandler {
  return async (req, res) => {
    const body = await guardSeq(ctx, req, req.body?.model_id, req.body?.seq_id, async () => parse(req));
    const model = await requireModelForOp(ctx, req, body.model_id);
    const data = await guardSeq(ctx, req, body.model_id, body.seq_id, async () => job(body, model, req));
    const requestId = await submitTrainOp(ctx, req, model, body.seq_id, data);
    res.json({ request_id: requestId, model_id: body.model_id });
  };
}

/** A JSON body of `schema`, for the op `what`. */
const json =
  <S extends z.ZodType<{ model_id: string; seq_id: number }>>(schema: S, what: string) =>
  (req: Request): z.output<S> =>
    parseBody(schema, req.body, what);

/** Where a save of `model` under `kind/name` goes: its tinker path and its directory. */
function savePath(ctx: ApiContext, model: ModelRecord, kind: 'weights' | 'sampler_weights' | 'external_weights', name: string) {
  const tp = { modelId: model.model_id, kind, name };
  return { tinker_path: formatTinkerPath(tp), dir: storageDirFor(ctx.config.storageDir, tp) };
}

export function trainingRoutes(ctx: ApiContext, direct: DirectRoutes): Router {
  const r = Router();

  // The body is read only up to its bound (express answers past it before buffering the rest).
  direct.post(
    r,
    '/forward_backward',
    express.raw({ type: () => true, limit: `${ctx.config.maxTrainBodyMb ?? 64}mb` }),
    orderedOp(
      ctx,
      (req) => {
        if (!Buffer.isBuffer(req.body) || req.body.length === 0) throw invalid(`forward_backward needs the Tinker SDK's protobuf ForwardBackwardRequest body (Content-Type: ${PROTOBUF_CONTENT_TYPE})`);
        if (req.is('json') || req.is('text/*') || req.is('application/x-www-form-urlencoded'))
          throw invalid(`forward_backward takes the Tinker SDK's protobuf ForwardBackwardRequest body (Content-Type: ${PROTOBUF_CONTENT_TYPE}), not ${req.get('content-type')}`);
        const fb = decodeForwardBackwardRequest(req.body);
        if (!fb.model_id) throw invalid('forward_backward: model_id is required');
        if (fb.seq_id < 1) throw invalid(`forward_backward: seq_id must be ≥ 1, got ${fb.seq_id}`);
        return fb;
      },
      (fb, model, req) => forwardBackwardJob(ctx, req, fb, model),
    ),
  );

  direct.post(
    r,
    '/optim_step',
    orderedOp(ctx, json(OptimStepBody, 'optim_step'), (b) => ({ op: 'optim_step', model_id: b.model_id, seq_id: b.seq_id, adam: (b.adam_params ?? b.optim_params)! })),
  );

  r.post(
    '/save_weights_for_sampler',
    orderedOp(ctx, json(SaveWeightsForSamplerBody, 'save_weights_for_sampler'), async (b, model, req) => {
      const named = (b.path ?? null) !== null;
      const to = savePath(ctx, model, 'sampler_weights', named ? b.path! : `ephemeral-${b.seq_id}`);
      await ensureRoom(ctx, req, 'ckpts', () => ctx.registry.checkpoints.hasRecord(to.tinker_path));
      // An unnamed save makes a sampling session too.
      if (!named) await ensureRoom(ctx, req, 'samplers');
      return {
        op: 'save_weights_for_sampler',
        model_id: model.model_id,
        seq_id: b.seq_id,
        ...to,
        sampling_session_id: named ? null : resourceIds.samplingSession(model.session_id, b.sampling_session_seq_id!),
        kind: b.kind,
        ttl_seconds: b.ttl_seconds ?? null,
        user_metadata: b.user_metadata ?? null,
      };
    }),
  );

  // save_state / save_weights: adapter and optimizer as tinker://<model_id>/weights/<name>.
  r.post(
    '/save_weights',
    orderedOp(ctx, json(SaveWeightsBody, 'save_weights'), async (b, model, req) => {
      const to = savePath(ctx, model, 'weights', b.path);
      await assertSaveAllowed(ctx.registry.checkpoints, { type: 'training', tinker_path: to.tinker_path, overwrite: b.overwrite });
      await ensureRoom(ctx, req, 'ckpts', () => ctx.registry.checkpoints.hasRecord(to.tinker_path));
      return {
        op: 'save_weights',
        model_id: model.model_id,
        seq_id: b.seq_id,
        ...to,
        overwrite: b.overwrite,
        ttl_seconds: b.ttl_seconds ?? null,
        user_metadata: b.user_metadata ?? null,
      };
    }),
  );

  // load_state / load_state_with_optimizer; without a model_id, create_training_client_from_state.
  const loadWeights = orderedOp(ctx, json(LoadWeightsBody, 'load_weights'), async (b, model, req) => {
    const ckpt = await loadableCheckpoint(ctx, req, b.path, model);
    return { op: 'load_weights', model_id: model.model_id, seq_id: b.seq_id, tinker_path: ckpt.tinker_path, dir: ckpt.dir, optimizer: b.optimizer };
  });
  r.post('/load_weights', async (req, res, next) => {
    if (req.body && req.body.model_id === undefined && req.body.session_id !== undefined)
      res.json(await createModelFromCheckpoint(ctx, req, parseBody(CreateViaLoadBody, req.body, 'load_weights')));
    else await loadWeights(req, res, next);
  });

  // save_weights_external: the adapter as plain (or age-encrypted) files, downloadable through signed URLs.
  r.post(
    '/save_weights_external',
    orderedOp(
      ctx,
      (req) => {
        const b = parseBody(SaveWeightsExternalBody, req.body, 'save_weights_external');
        for (const rcp of b.age_encryption_recipients ?? []) {
          try {
            parseRecipient(rcp);
          } catch (e) {
            throw invalid(`age_encryption_recipients: ${(e as Error).message}`);
          }
        }
        return b;
      },
      async (b, model, req) => {
        const to = savePath(ctx, model, 'external_weights', b.path);
        await assertSaveAllowed(ctx.registry.checkpoints, { type: 'external', tinker_path: to.tinker_path });
        await ensureRoom(ctx, req, 'ckpts');
        return {
          op: 'save_weights_external',
          model_id: model.model_id,
          seq_id: b.seq_id,
          ...to,
          ttl_seconds: b.ttl_seconds ?? null,
          age_recipients: b.age_encryption_recipients ?? [],
        };
      },
    ),
  );

  return r;
}
