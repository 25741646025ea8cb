import { cp, rm } from 'node:fs/promises';
import type { Request } from 'express';
import { BrokerError, invalid } from '../../queues/contract/errors.js';
import { logger } from '../../queues/infra/logger.js';
import { resourceIds } from '../../queues/contract/names.js';
import type { CheckpointRecord } from '../../queues/registry/checkpoints.js';
import type { ModelRecord } from '../../queues/registry/models.js';
import type { LoraConfig } from '../../queues/contract/schemas.js';
import { tenantOf } from '../auth.js';
import type { ApiContext } from '../context.js';
import { CHECKPOINT_KINDS, formatTinkerPath, parseTinkerPath, storageDirFor, type CheckpointKind } from '../paths.js';
import { requireCheckpoint, requireSession } from '../tenants.js';
import { createSession } from './sessions.js';

/**
 * Checkpoints: their REST view, the checks before a load, copy, TTL, publishing, deletion, and the
 * sweeper that deletes checkpoints whose TTL ran out. Any API process may sweep; a per-checkpoint
 * lock in Redis keeps two from deleting the same one. The rules a save must keep are shared with
 * the agent (queues/runtime/checkpoints.ts).
 */
export function checkpointView(c: CheckpointRecord) {
  return {
    checkpoint_id: c.checkpoint_id,
    checkpoint_type: c.checkpoint_type,
    time: c.time,
    tinker_path: c.tinker_path,
    size_bytes: c.size_bytes,
    public: c.public,
    user_metadata: c.user_metadata,
    expires_at: c.expires_at,
  };
}

/** An ISO time `ttlS` seconds from `now`, or null for none. */
const expiry = (ttlS: number | null | undefined, now = Date.now()) => (ttlS ? new Date(now + ttlS * 1000).toISOString() : null);

/** The checkpoint named by a REST path (`/training_runs/<id>/checkpoints/<kind>/<name>`), or a 404. */
export async function checkpointAt(ctx: ApiContext, req: Request, access: 'read' | 'write'): Promise<CheckpointRecord> {
  const { id: modelId, kind, name } = req.params as { id: string; kind: string; name: string };
  if (!(CHECKPOINT_KINDS as readonly string[]).includes(kind))
    throw invalid(`checkpoint ids are ${CHECKPOINT_KINDS.map((k) => `${k}/<name>`).join(', ')}; got ${kind}/${name}`);
  return requireCheckpoint(ctx, req, formatTinkerPath({ modelId, kind: kind as CheckpointKind, name }), access);
}

/** The training checkpoint at `path`, checked for loading into a model of `base` with `lora` (when given). */
export async function loadableCheckpoint(
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

export async function setCheckpointTtl(ctx: ApiContext, c: CheckpointRecord, ttlS: number | null): Promise<void> {
  await ctx.registry.checkpoints.put({ ...c, expires_at: expiry(ttlS) });
}

/** Publishes (or unpublishes) a checkpoint; doing it twice is a CONFLICT. */
export async function setCheckpointPublic(ctx: ApiContext, c: CheckpointRecord, value: boolean): Promise<void> {
  if (c.public === value) throw new BrokerError('CONFLICT', `checkpoint ${c.tinker_path} is already ${value ? 'public' : 'private'}`);
  await ctx.registry.checkpoints.put({ ...c, public: value });
}

/** The sampler weights a sampling session pins: `path` must name a sampler version the caller may read. */
export async function samplerWeights(ctx: ApiContext, req: Request, path: string): Promise<CheckpointRecord> {
  if (parseTinkerPath(path).kind !== 'sampler_weights')
    throw invalid(`'${path}' holds training state; sample from a sampler_weights path (save_weights_for_sampler)`);
  return requireCheckpoint(ctx, req, path, 'read', 'sampler weights');
}

/** The untrainable training run that holds copied weights (copy_weights). */
async function holdCopiedWeights(
  ctx: ApiContext,
  h: { sessionId: string; modelSeqId: number; from: CheckpointRecord; tenant: string },
): Promise<ModelRecord> {
  const holder = await ctx.registry.models.putIfAbsent({
    model_id: resourceIds.model(h.sessionId, h.modelSeqId),
    session_id: h.sessionId,
    base_model: h.from.base_model,
    arch: 'copy',
    vocab_size: 0,
    lora: h.from.lora,
    agent_id: '',
    train_queue: '',
    created_at: new Date().toISOString(),
    lost_reason: `it holds copied weights (copy_weights) and cannot be trained; use create_training_client_from_state`,
    tenant: h.tenant,
    max_context_length: null,
    orphaned_at: null,
  }, ctx.config.retentionS);
  await ctx.registry.models.index(holder, ctx.config.retentionS);
  return holder;
}

/**
 * copy_weights: a copy of a checkpoint (files and record) held by a new, untrainable training run
 * in the given session (or a new one). An `X-Idempotency-Key` makes a repeated copy return the first one's path.
 */
export async function copyCheckpoint(
  ctx: ApiContext,
  req: Request,
  body: { source_path: string; session_id?: string | null | undefined; model_seq_id?: number | null | undefined; ttl_seconds?: number | null | undefined },
  idempotencyKey: string | undefined,
): Promise<string> {
  const tenant = tenantOf(req);
  const idemKey = idempotencyKey ? ctx.names.copyIdempotency(tenant, idempotencyKey) : null;
  if (idemKey) {
    const prev = await ctx.redis.get(idemKey);
    if (prev) return prev;
  }
  const src = parseTinkerPath(body.source_path);
  const c = await requireCheckpoint(ctx, req, body.source_path, 'read');
  let sessionId = body.session_id ?? null;
  if (sessionId) await requireSession(ctx, req, sessionId);
  else sessionId = await createSession(ctx, req, { tags: ['copy_weights'] });
  const holder: ModelRecord = await holdCopiedWeights(ctx, { sessionId, modelSeqId: body.model_seq_id ?? 0, from: c, tenant });
  const tp = { modelId: holder.model_id, kind: src.kind, name: src.name };
  const dir = storageDirFor(ctx.config.storageDir, tp);
  await cp(c.dir, dir, { recursive: true, force: true });
  const now = Date.now();
  const tinkerPath = formatTinkerPath(tp);
  await ctx.registry.checkpoints.put({
    ...c,
    tinker_path: tinkerPath,
    model_id: holder.model_id,
    dir,
    time: new Date(now).toISOString(),
    expires_at: expiry(body.ttl_seconds, now),
    public: false,
    ephemeral: false,
    tenant,
  });
  if (idemKey) await ctx.redis.set(idemKey, tinkerPath, 'EX', 86_400);
  return tinkerPath;
}

export async function deleteCheckpoint(ctx: ApiContext, c: CheckpointRecord): Promise<void> {
  await ctx.registry.checkpoints.deleteRecord(c, ctx.config.retentionS);
  await rm(c.dir, { recursive: true, force: true });
}

export async function sweepExpiredCheckpoints(ctx: ApiContext): Promise<number> {
  let n = 0;
  for (const c of await ctx.registry.checkpoints.expired()) {
    const lock = ctx.names.checkpointSweepLock(c.tinker_path);
    if ((await ctx.redis.set(lock, '1', 'PX', 60_000, 'NX')) !== 'OK') continue;
    await deleteCheckpoint(ctx, c);
    // Gone from the expiry set: no sweep picks it up again (one that read it before finds nothing to delete).
    await ctx.redis.del(lock);
    n++;
    logger.info('checkpoint expired', { tinkerPath: c.tinker_path });
  }
  return n;
}

/** Runs the sweeper every `intervalMs`; returns a function that stops it. */
export function startCheckpointSweeper(ctx: ApiContext, intervalMs = 30_000): () => void {
  let running = false;
  const t = setInterval(() => {
    if (running) return;
    running = true;
    sweepExpiredCheckpoints(ctx)
      .catch((e) => logger.warn('checkpoint sweep failed', { error: String(e) }))
      .finally(() => (running = false));
  }, intervalMs);
  t.unref();
  return () => clearInterval(t);
}
