import type { Request } from 'express';
import { checkpointMissing } from '../queues/runtime/checkpoints.js';
import { BrokerError } from '../queues/contract/errors.js';
import type { CheckpointRecord } from '../queues/registry/checkpoints.js';
import type { ModelRecord } from '../queues/registry/models.js';
import type { SamplingSessionRecord } from '../queues/registry/samplers.js';
import { tenantOf } from './auth.js';
import type { ApiContext } from './context.js';

/**
 * The one tenant guard. Every route that names a session, model, sampling session, checkpoint or
 * future resolves it here: a resource of another tenant answers exactly as a resource that does
 * not exist (404, same message), so no tenant can learn what another holds. The only deliberate
 * exception: a published (`public`) checkpoint can be *read* by any tenant (sampled, loaded,
 * copied, described, downloaded), never changed. A future's owner is checked where its state is
 * read (api/futures.ts, in the same round trip for a training op), with the same rule.
 */

const notFound = (m: string) => new BrokerError('NOT_FOUND', m);

function owns(req: Request, owner: string | null | undefined): boolean {
  // Records older than tenants (owner '') belong to no tenant.
  return !!owner && owner === tenantOf(req);
}

/** The one answer for a session that does not exist, has expired or is another tenant's. */
export const unknownSession = (sessionId: string) => notFound(`unknown session '${sessionId}': call create_session first`);

export async function requireSession(ctx: ApiContext, req: Request, sessionId: string): Promise<void> {
  if (!owns(req, await ctx.registry.sessions.tenantOf(sessionId))) throw unknownSession(sessionId);
}

export async function requireModel(ctx: ApiContext, req: Request, modelId: string): Promise<ModelRecord> {
  const m = await ctx.registry.models.get(modelId);
  if (!m || !owns(req, m.tenant)) throw unknownModel(modelId);
  return m;
}

/**
 * requireModel for a training op's job: the record may be this process's recent copy
 * (ModelRegistry.placed), so the op must be submitted with the gate's `checkModel`, which checks in
 * the submit's script that the model still exists and is not lost.
 */
export async function requireModelForOp(ctx: ApiContext, req: Request, modelId: string): Promise<ModelRecord> {
  const m = await ctx.registry.models.placed(modelId);
  if (!m || !owns(req, m.tenant)) throw unknownModel(modelId);
  return m;
}

const unknownModel = (modelId: string) => notFound(`unknown model_id '${modelId}': create it with create_model first`);

/** Whether the model exists and belongs to the caller (no error). */
export async function ownsModel(ctx: ApiContext, req: Request, modelId: string): Promise<boolean> {
  const m = await ctx.registry.models.get(modelId);
  return !!m && owns(req, m.tenant);
}

/** The caller's sampling session (a read up to SESSION_REUSE_MS old may answer: SamplerRegistry.recent). */
export async function requireSamplingSession(ctx: ApiContext, req: Request, id: string): Promise<SamplingSessionRecord> {
  const s = await ctx.registry.samplers.recent(id);
  if (!s || !owns(req, s.tenant)) throw notFound(`unknown sampling_session_id '${id}'`);
  return s;
}

/**
 * A checkpoint by tinker path. `read` also admits another tenant's published checkpoint; `write`
 * (delete, TTL, publish) only the owner's.
 */
export async function requireCheckpoint(
  ctx: ApiContext,
  req: Request,
  tinkerPath: string,
  access: 'read' | 'write',
  what = 'checkpoint',
): Promise<CheckpointRecord> {
  const c = await ctx.registry.checkpoints.get(tinkerPath);
  if (!c || !(owns(req, c.tenant) || (access === 'read' && c.public)))
    throw checkpointMissing(tinkerPath, what);
  return c;
}

/** Records the caller as the owner of a future it is handed; returns the request_id. */
export async function issueFuture(ctx: ApiContext, req: Request, requestId: string): Promise<string> {
  // Owner records outlive the job (kept for the retention after it finishes).
  await ctx.registry.futures.setOwner(requestId, tenantOf(req), ctx.config.retentionS * 2);
  return requestId;
}
