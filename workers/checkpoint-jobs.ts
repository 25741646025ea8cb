import { existsSync } from 'node:fs';
import { readdir, rename, rm, stat } from 'node:fs/promises';
import path from 'node:path';
import { encryptFileInPlace } from '../queues/infra/age.js';
import { assertSaveAllowed } from '../queues/runtime/checkpoints.js';
import type { CheckpointRecord } from '../queues/registry/checkpoints.js';
import type { Registry } from '../queues/registry/index.js';
import type { ModelRecord } from '../queues/registry/models.js';
import type { SaveExternalJob, SaveSamplerJob, SaveStateJob } from '../queues/contract/schemas.js';
import type { EngineAdapter } from './adapters/adapter.js';

/**
 * The checkpoint jobs of a worker agent: save_weights_for_sampler, save_weights (state, with the
 * optimizer) and save_weights_external. Each checks that the save is allowed (queues/runtime/checkpoints.ts),
 * has the engine write the files, and records the checkpoint in the registry; an overwritten state
 * keeps its old files until the new ones are complete. Loading a state is the engine's alone
 * (workers/agent/training.ts). docs/architecture.md "Checkpoints" has the layout.
 */
export class CheckpointJobs {
  constructor(
    private readonly registry: Registry,
    private readonly adapter: EngineAdapter,
    /** How long unnamed sampler saves, sampling sessions and in-flight targets live (the storage retention). */
    private readonly retentionS: number,
  ) {}

  /** The model a checkpoint job saves (it exists: create_model ran before any op of the model). */
  private async modelOf(job: { model_id: string }): Promise<ModelRecord> {
    return (await this.registry.models.get(job.model_id))!;
  }

  private checkpointRecord(
    model: ModelRecord,
    job: { tinker_path: string; dir: string; ttl_seconds: number | null; user_metadata: Record<string, string> | null },
    type: CheckpointRecord['checkpoint_type'],
    extra: { size_bytes: number; has_optimizer: boolean; ephemeral: boolean },
  ): CheckpointRecord {
    const now = Date.now();
    // Unnamed sampler saves live as long as futures do.
    const ttl = job.ttl_seconds ?? (extra.ephemeral ? this.retentionS : null);
    return {
      tinker_path: job.tinker_path,
      model_id: model.model_id,
      checkpoint_id: job.tinker_path.split('/').slice(-2).join('/'),
      checkpoint_type: type,
      base_model: model.base_model,
      lora: model.lora,
      dir: job.dir,
      time: new Date(now).toISOString(),
      expires_at: ttl === null ? null : new Date(now + ttl * 1000).toISOString(),
      public: false,
      user_metadata: job.user_metadata,
      tenant: model.tenant,
      ...extra,
    };
  }

  async saveSampler(job: SaveSamplerJob): Promise<{ path: string; sampling_session_id: string | null }> {
    const ephemeral = job.sampling_session_id !== null;
    // A named sampler version is immutable: a second save under its name is refused.
    if (!ephemeral) await assertSaveAllowed(this.registry.checkpoints, { type: 'sampler', tinker_path: job.tinker_path });
    if (existsSync(job.dir)) await rm(job.dir, { recursive: true, force: true }); // leftovers of an expired or deleted checkpoint
    const { size_bytes } = await this.written(job.dir, (dir) => this.adapter.saveSampler({ ...job, dir }));
    const model = await this.modelOf(job);
    await this.registry.checkpoints.put(this.checkpointRecord(model, job, 'sampler', { size_bytes, has_optimizer: false, ephemeral }));
    const inflight = job.kind === 'inflight';
    // The target moves before the save completes: a client created from this save never sees older weights.
    if (inflight) await this.registry.samplers.setInflightTarget(model.model_id, { model_path: job.tinker_path, adapter_dir: job.dir, seq_id: job.seq_id }, this.retentionS);
    if (job.sampling_session_id) {
      await this.registry.samplers.put(
        {
          sampling_session_id: job.sampling_session_id,
          session_id: model.session_id,
          base_model: model.base_model,
          model_path: job.tinker_path,
          adapter_dir: job.dir,
          inflight_model_id: inflight ? model.model_id : null,
          tenant: model.tenant,
        },
        this.retentionS,
      );
      await this.registry.samplers.index(model.session_id, job.sampling_session_id, this.retentionS);
    }
    return { path: job.tinker_path, sampling_session_id: job.sampling_session_id };
  }

  async saveExternal(job: SaveExternalJob): Promise<{ path: string; size_bytes: number }> {
    await assertSaveAllowed(this.registry.checkpoints, { type: 'external', tinker_path: job.tinker_path });
    if (existsSync(job.dir)) await rm(job.dir, { recursive: true, force: true });
    await this.written(job.dir, (dir) => this.adapter.saveSampler({ ...job, dir, op: 'save_weights_for_sampler', sampling_session_id: null, user_metadata: null }));
    let size = 0;
    for (const f of await readdir(job.dir, { recursive: true, withFileTypes: true })) {
      if (!f.isFile()) continue;
      const p = path.join(f.parentPath, f.name);
      const out = job.age_recipients.length ? await encryptFileInPlace(p, job.age_recipients) : p;
      size += (await stat(out)).size;
    }
    await this.registry.checkpoints.put(
      this.checkpointRecord(await this.modelOf(job), { ...job, user_metadata: null }, 'external', { size_bytes: size, has_optimizer: false, ephemeral: false }),
    );
    return { path: job.tinker_path, size_bytes: size };
  }

  /**
   * Writes a checkpoint directory under a temporary name (`<dir>.tmp-<ms>`, which the rebuild skips)
   * and renames it to `dir` once complete: a save that fails (a full disk) leaves no directory under
   * the final name for a later start to take for a checkpoint.
   */
  private async written<T>(dir: string, write: (tmp: string) => Promise<T>): Promise<T> {
    const tmp = `${dir}.tmp-${Date.now()}`;
    try {
      const r = await write(tmp);
      await rename(tmp, dir);
      return r;
    } catch (e) {
      await rm(tmp, { recursive: true, force: true }).catch(() => undefined);
      throw e;
    }
  }

  async saveState(job: SaveStateJob): Promise<{ path: string }> {
    await assertSaveAllowed(this.registry.checkpoints, { type: 'training', tinker_path: job.tinker_path, overwrite: job.overwrite });
    // Overwrite keeps the old files until the new ones are complete.
    const old = `${job.dir}.old-${Date.now()}`;
    const hadDir = existsSync(job.dir);
    if (hadDir) await rename(job.dir, old);
    try {
      const { size_bytes } = await this.adapter.saveState(job.model_id, job.dir, true);
      await this.registry.checkpoints.put(this.checkpointRecord(await this.modelOf(job), job, 'training', { size_bytes, has_optimizer: true, ephemeral: false }));
    } catch (e) {
      if (hadDir) {
        await rm(job.dir, { recursive: true, force: true });
        await rename(old, job.dir);
      }
      throw e;
    }
    if (hadDir) await rm(old, { recursive: true, force: true });
    return { path: job.tinker_path };
  }
}
