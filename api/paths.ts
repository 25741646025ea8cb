import path from 'node:path';
import { invalid } from '../queues/contract/errors.js';

/**
 * `tinker://<model_id>/<kind>/<name>` paths (kind `weights`, `sampler_weights` or `external_weights`) and where
 * their files live under the storage directory.
 */
export type CheckpointKind = 'weights' | 'sampler_weights' | 'external_weights';
export type TinkerPath = { modelId: string; kind: CheckpointKind; name: string };

export const CHECKPOINT_KINDS: readonly CheckpointKind[] = ['weights', 'sampler_weights', 'external_weights'];

export function formatTinkerPath(p: TinkerPath): string {
  return `tinker://${p.modelId}/${p.kind}/${p.name}`;
}

export function parseTinkerPath(s: string): TinkerPath {
  const m = /^tinker:\/\/([^/]+)\/(weights|sampler_weights|external_weights)\/([^/]+)$/.exec(s);
  if (!m) throw invalid(`'${s}' is not a tinker path of the form tinker://<model_id>/weights|sampler_weights|external_weights/<name>`);
  return { modelId: m[1]!, kind: m[2] as TinkerPath['kind'], name: m[3]! };
}

export function storageDirFor(storageRoot: string, p: TinkerPath): string {
  return path.join(storageRoot, p.modelId.replace(/[^A-Za-z0-9._-]/g, '_'), p.kind, p.name);
}
