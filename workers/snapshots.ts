import { readdir, rm } from 'node:fs/promises';
import path from 'node:path';
import type { Redis } from 'ioredis';
import { jobIds, shortHash, type Names } from '../queues/contract/names.js';
import { TrainJob, type LoraConfig } from '../queues/contract/schemas.js';
import type { Logger } from '../queues/infra/logger.js';
import type { Outcomes } from '../queues/runtime/outcomes.js';
import type { ModelRecord, ModelRegistry } from '../queues/registry/models.js';

/**
 * Continuous snapshots and recovery from them (docs/reliability.md, "A crashed engine or agent").
 *
 * After an optim_step the agent asks the engine for a snapshot of the model when one is due (every
 * `everySteps` optim_steps or `everyS` seconds). The engine copies the state to CPU memory and
 * writes it on a thread of its own (workers/python/tinker_engine/snapshot.py), in save_state's
 * format, under `<storage>/snapshots/<model>/<seq_id>`. Only the copy delays the next op.
 *
 * When the engine or the agent dies, the agent loads each of its models from its newest complete
 * snapshot, then re-runs, in order, the ops after it whose outcome is recorded as done, from their
 * payloads in Redis. The op that was running has no done outcome: it fails with OUTCOME_UNKNOWN
 * and is not re-run, so the model is exactly as if it never ran. A model without a snapshot, or
 * whose ops after the snapshot are no longer all in Redis, is lost as before, with a reason that
 * says which step it could have come back to.
 */

export type SnapshotPolicy = { everySteps: number; everyS: number; keep: number };

/** What recovery needs of the engine. */
export type RecoveryEngine = {
  createModel(job: { op: 'create_model'; model_id: string; base_model: string; lora: LoraConfig }): Promise<unknown>;
  loadState(modelId: string, dir: string, optimizer: boolean): Promise<unknown>;
  forwardBackward(job: Extract<TrainJob, { op: 'forward_backward' }>): Promise<unknown>;
  optimStep(job: Extract<TrainJob, { op: 'optim_step' }>): Promise<unknown>;
  unloadModel(modelId: string): Promise<void>;
};

/** A model's recovery: back, or not (`reason` null: it had no snapshot, nothing to say beyond the loss itself). */
export type Recovered = { recovered: true; seqId: number; replayed: number } | { recovered: false; reason: string | null };

/** The directory of a model's snapshots (a hash: model ids hold ':' and any client text). */
export function snapshotRoot(storageDir: string, modelId: string): string {
  return path.join(storageDir, 'snapshots', shortHash(modelId, 24));
}

/**
 * The newest complete snapshot of a model: a directory named by its seq_id in digits (the engine
 * pads them; an incomplete one has `.tmp-` in its name).
 */
export async function latestSnapshot(root: string): Promise<{ seqId: number; dir: string } | null> {
  let names: string[];
  try {
    names = await readdir(root);
  } catch {
    return null;
  }
  const done = names.filter((n) => /^\d+$/.test(n)).sort((a, b) => Number(a) - Number(b));
  const last = done.at(-1);
  return last === undefined ? null : { seqId: Number(last), dir: path.join(root, last) };
}

/** When each model's next snapshot is due. */
export class SnapshotSchedule {
  private readonly last = new Map<string, { steps: number; at: number }>();
  constructor(readonly policy: SnapshotPolicy) {}

  get enabled(): boolean {
    return this.policy.everySteps > 0 || this.policy.everyS > 0;
  }

  /** Counts one optim_step of the model; true when a snapshot is due now. */
  stepped(modelId: string, now = Date.now()): boolean {
    if (!this.enabled) return false;
    const l = this.last.get(modelId) ?? { steps: 0, at: now };
    l.steps++;
    this.last.set(modelId, l);
    const bySteps = this.policy.everySteps > 0 && l.steps >= this.policy.everySteps;
    const byTime = this.policy.everyS > 0 && now - l.at >= this.policy.everyS * 1000;
    // The first step of a model is always snapshotted when time decides: there is nothing to lose yet, and a crash soon after must find one.
    return bySteps || byTime || (this.policy.everySteps === 0 && l.steps === 1);
  }

  taken(modelId: string, now = Date.now()): void {
    this.last.set(modelId, { steps: 0, at: now });
  }

  forget(modelId: string): void {
    this.last.delete(modelId);
  }
}

/**
 * Loads `rec` into the (new) engine from its newest snapshot and re-runs the ops after it whose
 * outcome is done. On failure the model is left half-built in the engine: the caller unloads it.
 */
export async function recoverModel(
  deps: { redis: Redis; names: Names; outcomes: Outcomes; engine: RecoveryEngine; storageDir: string; log: Logger },
  rec: ModelRecord,
): Promise<Recovered> {
  const snap = await latestSnapshot(snapshotRoot(deps.storageDir, rec.model_id));
  if (!snap) return { recovered: false, reason: null };
  // Every op below the gate's next seq_id was queued; those after the snapshot with a done outcome took effect.
  const next = Number((await deps.redis.get(deps.names.gateNext(rec.model_id))) ?? snap.seqId + 1);
  const replay: TrainJob[] = [];
  for (let s = snap.seqId + 1; s < next; s++) {
    const jobId = jobIds.train(rec.model_id, s);
    const o = await deps.outcomes.get(jobId);
    if (o?.state !== 'done' || !['forward_backward', 'optim_step', 'load_weights'].includes(o.op)) continue;
    const raw = await deps.redis.hget(`${deps.names.bull}:${rec.train_queue}:${jobId}`, 'data');
    const job = raw === null ? null : TrainJob.safeParse(JSON.parse(raw));
    if (!job?.success)
      return { recovered: false, reason: `its newest snapshot covers seq_id ${snap.seqId}, and the payload of its ${o.op} at seq_id ${s}, which ran after it, is no longer held in Redis` };
    replay.push(job.data);
  }
  await deps.engine.createModel({ op: 'create_model', model_id: rec.model_id, base_model: rec.base_model, lora: rec.lora });
  await deps.engine.loadState(rec.model_id, snap.dir, true);
  for (const job of replay) {
    if (job.op === 'forward_backward') await deps.engine.forwardBackward(job);
    else if (job.op === 'optim_step') await deps.engine.optimStep(job);
    else if (job.op === 'load_weights') await deps.engine.loadState(rec.model_id, job.dir, job.optimizer);
  }
  deps.log.info('model recovered from its snapshot', { model: rec.model_id, snapshotSeqId: snap.seqId, replayed: replay.length });
  return { recovered: true, seqId: snap.seqId, replayed: replay.length };
}

/**
 * An agent's snapshots: takes them after optim_steps when due, recovers its models from them, and
 * removes a model's snapshots once the model is gone.
 */
export class AgentSnapshots {
  readonly schedule: SnapshotSchedule;
  constructor(
    private readonly o: {
      policy: SnapshotPolicy | undefined;
      storageDir: string;
      adapter: RecoveryEngine & { snapshot?(modelId: string, root: string, seqId: number, keep: number): Promise<{ last_error: string | null }> };
      redis: Redis;
      names: Names;
      outcomes: Outcomes;
      models: Pick<ModelRegistry, 'get' | 'markLost'>;
      log: Logger;
    },
  ) {
    this.schedule = new SnapshotSchedule(o.policy ?? { everySteps: 0, everyS: 0, keep: 1 });
  }

  get enabled(): boolean {
    return this.schedule.enabled && this.o.adapter.snapshot !== undefined;
  }

  /**
   * After the model's optim_step at `seqId`: a snapshot when one is due. Only the engine's copy of
   * the state waits here; a failure is logged, never the op's.
   */
  async afterOptimStep(modelId: string, seqId: number): Promise<void> {
    if (!this.enabled || !this.schedule.stepped(modelId)) return;
    try {
      const r = await this.o.adapter.snapshot!(modelId, snapshotRoot(this.o.storageDir, modelId), seqId, this.schedule.policy.keep);
      this.schedule.taken(modelId);
      if (r.last_error) this.o.log.warn('a snapshot could not be written; the next one tries again', { model: modelId, error: r.last_error });
    } catch (e) {
      this.o.log.warn('snapshot not taken', { model: modelId, error: String(e) });
    }
  }

  /** Recovers each model into the current engine; returns those that came back. A failure is logged with its reason. */
  async recover(records: ModelRecord[]): Promise<Map<string, Recovered>> {
    const out = new Map<string, Recovered>();
    if (!this.enabled) return out;
    for (const rec of records) {
      let r: Recovered;
      try {
        r = await recoverModel({ ...this.o, engine: this.o.adapter }, rec);
      } catch (e) {
        r = { recovered: false, reason: `loading its snapshot failed: ${String(e)}` };
      }
      if (!r.recovered) await this.o.adapter.unloadModel(rec.model_id).catch(() => undefined);
      out.set(rec.model_id, r);
    }
    return out;
  }

  /**
   * Brings the models back into the current engine from their snapshots; returns those that came
   * back. One whose recovery failed is marked lost, its reason `why` and what stopped it; the caller
   * marks the others (no snapshot) lost as before.
   */
  async bringBack(ids: string[], why: string): Promise<Set<string>> {
    const recs = (await Promise.all(ids.map((id) => this.o.models.get(id)))).filter((r): r is ModelRecord => r !== null && r.lost_reason === null);
    const back = new Set<string>();
    for (const [id, r] of await this.recover(recs)) {
      if (r.recovered) back.add(id);
      else if (r.reason !== null) {
        await this.o.models.markLost(id, `${why}; ${r.reason}; load it from a saved checkpoint`);
        await this.drop(id);
      }
    }
    return back;
  }

  /** Removes a model's snapshots (it was unloaded or is lost). */
  async drop(modelId: string): Promise<void> {
    this.schedule.forget(modelId);
    await rm(snapshotRoot(this.o.storageDir, modelId), { recursive: true, force: true }).catch(() => undefined);
  }
}
