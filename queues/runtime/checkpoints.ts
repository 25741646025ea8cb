import { BrokerError, invalid } from '../contract/errors.js';
import type { CheckpointRecord, CheckpointRegistry } from '../registry/checkpoints.js';

/**
 * The rules of saving and loading checkpoints, with their messages, in one place: the API checks
 * them before it queues an op (a refusal is an HTTP error), the agent again when the op runs (an
 * op queued before it may have saved or deleted the checkpoint since).
 */

/** A checkpoint (or sampler weights, external weights) that is not there: never saved, deleted or expired. */
export function checkpointMissing(tinkerPath: string, what = 'checkpoint'): BrokerError {
  return new BrokerError('NOT_FOUND', `${what} ${tinkerPath} does not exist (never saved, deleted or expired)`);
}

/** The checkpoint an op loads from, or NOT_FOUND. */
export async function requireCheckpointRecord(checkpoints: CheckpointRegistry, tinkerPath: string): Promise<CheckpointRecord> {
  const c = await checkpoints.get(tinkerPath);
  if (!c) throw checkpointMissing(tinkerPath);
  return c;
}

/**
 * Refuses a save over an existing checkpoint: training state (`training`) only with `overwrite`;
 * named sampler versions and external weights never (they are immutable: clients may hold them).
 */
export async function assertSaveAllowed(
  checkpoints: CheckpointRegistry,
  save: { type: CheckpointRecord['checkpoint_type']; tinker_path: string; overwrite?: boolean },
): Promise<void> {
  if (!(await checkpoints.get(save.tinker_path))) return;
  const p = save.tinker_path;
  if (save.type === 'training' && !save.overwrite) throw invalid(`checkpoint ${p} already exists; pass overwrite=True to replace it`);
  if (save.type === 'sampler') throw invalid(`sampler weights ${p} already exist; save under a new name`);
  if (save.type === 'external') throw invalid(`external weights ${p} already exist; save under a new name`);
}
