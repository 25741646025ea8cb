import { rm } from 'node:fs/promises';
import { logger } from '../queues/logger.js';
import type { CheckpointRecord } from '../queues/registry.js';
import type { ApiContext } from './context.js';

/**
 * Checkpoint files and records: the REST view of a checkpoint, deletion, and the sweeper that
 * deletes checkpoints whose TTL ran out. Any API process may sweep; a per-checkpoint lock in
 * Redis keeps two from deleting the same one.
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

export async function deleteCheckpoint(ctx: ApiContext, c: CheckpointRecord): Promise<void> {
  await ctx.registry.deleteCheckpointRecord(c);
  await rm(c.dir, { recursive: true, force: true });
}

export async function sweepExpiredCheckpoints(ctx: ApiContext): Promise<number> {
  let n = 0;
  for (const c of await ctx.registry.expiredCheckpoints()) {
    const lock = `${ctx.names.prefix}:sweep:${c.tinker_path}`;
    if ((await ctx.redis.set(lock, '1', 'PX', 60_000, 'NX')) !== 'OK') continue;
    await deleteCheckpoint(ctx, c);
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
