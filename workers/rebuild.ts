import { existsSync } from 'node:fs';
import { readdir, readFile, stat } from 'node:fs/promises';
import path from 'node:path';
import type { Logger } from '../queues/infra/logger.js';
import type { CheckpointRecord } from '../queues/registry/checkpoints.js';
import type { Registry } from '../queues/registry/index.js';
import type { ModelRecord } from '../queues/registry/models.js';

const KINDS = { weights: 'training', sampler_weights: 'sampler', external_weights: 'external' } as const;

/**
 * Rebuilds checkpoint records from the files on disk (`<storage>/<model_id>/<kind>/<name>`), for
 * checkpoints whose record Redis no longer has (a Redis restarted without its data, a record lost)
 * while their model's record exists (it names the tenant, base model and LoRA config). What only the
 * record knew comes back as defaults: no expiry, not public, no user metadata; the time is the
 * directory's mtime. Directories half-written or being replaced (`*.tmp-*`, `*.old-*`) are skipped, and
 * so is a sampler directory without an adapter (an interrupted save of an older version).
 * The unnamed sampler saves behind save_weights_and_get_sampling_client (`sampler_weights/ephemeral-<seq_id>`)
 * come back as what they were: unlisted, expiring `retentionS` after their mtime (the sweeper deletes
 * those already past it), so they neither become permanent nor keep their model's record.
 * Runs at every agent start; returns the tinker paths rebuilt.
 */
export async function rebuildCheckpoints(registry: Registry, storageDir: string, log: Logger, retentionS: number): Promise<string[]> {
  const rebuilt: string[] = [];
  if (!existsSync(storageDir)) return rebuilt;
  // Directory names are model ids with unsafe characters replaced (api/paths.ts): map them back.
  let byDir: Map<string, string> | null = null;
  const modelIdOf = async (dirName: string): Promise<string | null> => {
    if (!byDir) {
      byDir = new Map();
      let cursor = '0';
      const prefix = registry.names.model('');
      do {
        const [next, keys] = await registry.redis.scan(cursor, 'MATCH', `${prefix}*`, 'COUNT', 500);
        cursor = next;
        for (const k of keys) {
          const id = k.slice(prefix.length);
          byDir.set(id.replace(/[^A-Za-z0-9._-]/g, '_'), id);
        }
      } while (cursor !== '0');
    }
    return byDir.get(dirName) ?? null;
  };
  for (const modelEntry of await readdir(storageDir, { withFileTypes: true })) {
    if (!modelEntry.isDirectory() || modelEntry.name === 'drain' || modelEntry.name === 'snapshots') continue; // the drain's saves and the snapshots (workers/snapshots.ts) are no checkpoints
    const dirName = modelEntry.name;
    let model: ModelRecord | null | undefined;
    for (const [kind, type] of Object.entries(KINDS)) {
      const kindDir = path.join(storageDir, dirName, kind);
      if (!existsSync(kindDir)) continue;
      for (const e of await readdir(kindDir, { withFileTypes: true })) {
        if (!e.isDirectory() || /\.(tmp|old)-/.test(e.name)) continue;
        if (model === undefined) {
          const id = await modelIdOf(dirName);
          model = id === null ? null : await registry.models.get(id);
        }
        if (!model) {
          log.warn('checkpoint files without a model record are left alone', { dir: path.join(kindDir, e.name) });
          break;
        }
        const tinkerPath = `tinker://${model.model_id}/${kind}/${e.name}`;
        if (await registry.checkpoints.hasRecord(tinkerPath)) continue;
        const dir = path.join(kindDir, e.name);
        let size = 0;
        for (const f of await readdir(dir, { recursive: true, withFileTypes: true })) if (f.isFile()) size += (await stat(path.join(f.parentPath, f.name))).size;
        if (type === 'sampler' && !existsSync(path.join(dir, 'adapter_config.json'))) {
          log.warn('a sampler directory without an adapter (adapter_config.json) is left alone', { dir });
          continue;
        }
        let hasOptimizer = false;
        if (type === 'training') {
          try {
            hasOptimizer = JSON.parse(await readFile(path.join(dir, 'tinker_state.json'), 'utf8')).has_optimizer === true;
          } catch {
            log.warn('a training checkpoint without a readable tinker_state.json is left alone', { dir });
            continue;
          }
        }
        const mtime = (await stat(dir)).mtime;
        const ephemeral = type === 'sampler' && e.name.startsWith('ephemeral-');
        const rec: CheckpointRecord = {
          tinker_path: tinkerPath,
          model_id: model.model_id,
          checkpoint_id: `${kind}/${e.name}`,
          checkpoint_type: type,
          base_model: model.base_model,
          lora: model.lora,
          dir,
          time: mtime.toISOString(),
          size_bytes: size,
          expires_at: ephemeral ? new Date(mtime.getTime() + retentionS * 1000).toISOString() : null,
          public: false,
          has_optimizer: hasOptimizer,
          ephemeral,
          user_metadata: null,
          tenant: model.tenant,
        };
        await registry.checkpoints.put(rec);
        rebuilt.push(tinkerPath);
      }
    }
  }
  if (rebuilt.length) log.warn('checkpoint records rebuilt from the files on disk', { count: rebuilt.length });
  return rebuilt;
}
