import type { Request } from 'express';
import type { z } from 'zod';
import { BrokerError, invalid } from '../../queues/contract/errors.js';
import { checkCustomLoss, customLossInputs, CUSTOM_LOSS_OPS, type CustomLossSpec } from '../../queues/contract/custom-loss.js';
import { encodeRequestId } from '../../queues/contract/futures.js';
import { jobIds } from '../../queues/contract/names.js';
import type { Datum } from '../../queues/contract/schemas.js';
import { CustomLossRegistry, customLossId } from '../../queues/registry/custom-losses.js';
import type { ModelRecord } from '../../queues/registry/models.js';
import type { ApiContext } from '../context.js';
import type { CreateCustomLossBody } from '../http-schemas.js';
import { tenantOf } from '../auth.js';
import { issueFuture, requireSession } from '../tenants.js';

/**
 * Server-side custom losses: create_custom_loss checks the traced graph against the allowlist
 * (queues/contract/custom-loss.ts) and stores it for its session and tenant; a forward_backward
 * with `loss_fn: custom` and `loss_fn_config.loss_id` carries the stored graph to the engine, which
 * rebuilds it from the same allowlist (workers/python/tinker_engine/custom_loss.py).
 */

/**
 * The queue name of create_custom_loss's futures. The future is answered at once from an outcome
 * record the API writes (no job, no agent): the SDK awaits every create through a future.
 */
const NO_AGENT_QUEUE = 'train-api-custom-loss';

const registry = (ctx: ApiContext) => new CustomLossRegistry(ctx.registry.redis, ctx.registry.names);

/** create_custom_loss: the graph checked and stored; returns the request_id of its future, done already. */
export async function createCustomLoss(ctx: ApiContext, req: Request, body: z.output<typeof CreateCustomLossBody>): Promise<string> {
  await requireSession(ctx, req, body.session_id);
  const spec: CustomLossSpec = { name: body.name, inputs: body.inputs, graph: body.graph };
  checkCustomLoss(spec);
  const lossId = customLossId(body.session_id, body.custom_loss_seq_id);
  const tenant = tenantOf(req);
  const put = await registry(ctx).put(
    { loss_id: lossId, tenant, session_id: body.session_id, spec, created_at: new Date().toISOString() },
    body.custom_loss_seq_id,
    ctx.config.retentionS,
  );
  if (put === 'conflict') throw new BrokerError('CONFLICT', `custom_loss_seq_id ${body.custom_loss_seq_id} of session '${body.session_id}' already names another custom loss`);
  if (put === 'full') throw invalid(`session '${body.session_id}' has created ${CUSTOM_LOSS_OPS.max_losses_per_session} custom losses, the most one session may`);
  const jobId = jobIds.customLoss(body.session_id, body.custom_loss_seq_id);
  const requestId = await issueFuture(ctx, req, encodeRequestId({ queue: NO_AGENT_QUEUE, jobId }));
  await ctx.futures.outcomes.finish(jobId, '', { state: 'done', op: 'create_custom_loss', agent_id: 'api', result: { loss_id: lossId } });
  return requestId;
}

/**
 * A forward_backward with the custom loss `loss_fn_config.loss_id`: the stored loss, if the caller's
 * tenant created it; the datums checked against its declared inputs (the inputs it does not read dropped).
 */
export async function customLossForJob(
  ctx: ApiContext,
  req: Request,
  config: Record<string, number | string>,
  data: Datum[],
  _model: ModelRecord,
): Promise<{ spec: CustomLossSpec; data: Datum[] }> {
  const keys = Object.keys(config);
  const lossId = config.loss_id;
  if (typeof lossId !== 'string' || keys.length !== 1)
    throw invalid(`loss_fn '${CUSTOM_LOSS_OPS.loss_fn}' takes loss_fn_config {loss_id} (from create_custom_loss), got keys [${keys.join(', ')}]`);
  const rec = await registry(ctx).get(lossId, tenantOf(req), ctx.config.retentionS);
  if (!rec) throw new BrokerError('NOT_FOUND', `unknown custom loss '${lossId.slice(0, 200)}': create it with create_custom_loss in this session`);
  const kept = data.map((d, i) => ({ ...d, loss_fn_inputs: customLossInputs(rec.spec, d.loss_fn_inputs, `data[${i}]`) }));
  return { spec: rec.spec, data: kept };
}
