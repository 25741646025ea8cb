import type { Redis } from 'ioredis';
import type { Logger } from '../../queues/infra/logger.js';
import { jobIds, modelSideJobIds, type Names } from '../../queues/contract/names.js';
import type { Outcomes } from '../../queues/runtime/outcomes.js';
import { scripts } from '../../queues/runtime/scripts.js';
import { ModelRecord, type ModelRegistry } from '../../queues/registry/models.js';
import type { EngineAdapter } from '../adapters/adapter.js';
import type { AgentSnapshots } from '../snapshots.js';
import type { EngineSupervisor } from './engine.js';

/**
 * Adoption: a live agent takes in the models of a dead one (docs/reliability.md, "Another agent
 * adopts the models"). When the reaper finds an agent that snapshotted its models dead
 * (queues/runtime/liveness.ts), it lists them as orphans. Every agent that snapshots looks at the
 * orphans at each heartbeat; for one whose base model it trains, it takes the model's adoption
 * claim, loads the model from its newest snapshot and re-runs the ops after it that were done
 * (workers/snapshots.ts recoverModel), then, in one script (queues/runtime/lua/train-relocate.lua),
 * moves the model's unstarted ops from the dead agent's queue onto its own, in order, and makes the
 * record name itself. The client's loop goes on with the same model id; only the op that was
 * running when the agent died failed (OUTCOME_UNKNOWN).
 *
 * A model whose create_model had not run yet moves as it is (its create runs here). One that cannot
 * come back (no snapshot yet, its replay's payloads gone) is marked lost with the reason and its ops
 * still move here, where they fail with that reason. An orphan whose base no live agent trains stays
 * an orphan, its ops pending, until one starts, or until its record expires (the retention after
 * its last op): its snapshots are then removed by the next agent that looks.
 */

/** How long an adoption claim lasts: the load and replay of one model. */
const CLAIM_MS = 10 * 60_000;

export type AdoptionOptions = {
  agentId: string;
  /** This agent's training queue. */
  queue: string;
  redis: Redis;
  names: Names;
  models: Pick<ModelRegistry, 'orphans'>;
  outcomes: Outcomes;
  snapshots: AgentSnapshots;
  engine: Pick<EngineSupervisor, 'loaded' | 'served' | 'ensure'>;
  adapter: Pick<EngineAdapter, 'unloadModel'>;
  /** Whether this agent's engine trains. */
  trains: boolean;
  /** The agent takes no new work (draining, stopping). */
  halted: () => boolean;
  log: Logger;
};

export class Adoption {
  private running: Promise<string[]> | null = null;

  constructor(private readonly o: AdoptionOptions) {}

  /** One look at the orphans (the one under way, if any): adopts those this agent trains the base of; returns the ids adopted. */
  sweep(): Promise<string[]> {
    if (!this.o.trains || !this.o.snapshots.enabled) return Promise.resolve([]);
    this.running ??= this.look().finally(() => (this.running = null));
    return this.running;
  }

  private async look(): Promise<string[]> {
    const { redis, names, log } = this.o;
    const adopted: string[] = [];
    try {
      for (const id of await this.o.models.orphans()) {
        if (this.o.halted()) break;
        const raw = await redis.get(names.model(id));
        const rec = raw === null ? null : ModelRecord.parse(JSON.parse(raw));
        if (rec === null || rec.orphaned_at === null) {
          await redis.zrem(names.orphans(), id);
          // An orphan nobody adopted within its record's lifetime: its snapshots go with it.
          if (rec === null) await this.o.snapshots.drop(id);
          continue;
        }
        if (!this.o.engine.served.some((m) => m.name === rec.base_model && m.trainable)) continue;
        const claim = names.adoptClaim(id);
        if ((await redis.set(claim, this.o.agentId, 'PX', CLAIM_MS, 'NX')) !== 'OK') continue;
        try {
          if (await this.adopt(raw!, rec)) adopted.push(id);
        } catch (e) {
          log.error('model not adopted; another look at the next heartbeat', { model: id, error: String(e) });
        } finally {
          if ((await redis.get(claim)) === this.o.agentId) await redis.del(claim);
        }
      }
    } catch (e) {
      log.warn('orphans not read', { error: String(e) });
    }
    return adopted;
  }

  /** Loads `rec` here and moves it; false when it could not come back (marked lost) or was settled elsewhere meanwhile. */
  private async adopt(raw: string, rec: ModelRecord): Promise<boolean> {
    const { redis, names, outcomes, snapshots, engine, log } = this.o;
    const id = rec.model_id;
    await engine.ensure();
    let lost: string | null = null;
    let loaded = false;
    // A model whose create_model never ran has nothing to recover: its create moves here with its other ops.
    const created = (await outcomes.get(jobIds.createModel(id)))?.state === 'done';
    if (created) {
      const r = (await snapshots.recover([rec])).get(id);
      if (r?.recovered) loaded = true;
      else lost = `its worker agent '${rec.agent_id}' died; ${r?.reason ?? 'it had no snapshot yet'}; load it from a saved checkpoint`;
    }
    const next: ModelRecord = { ...rec, agent_id: this.o.agentId, train_queue: this.o.queue, orphaned_at: null, lost_reason: lost };
    const [movedBefore, movedAfter] = names.jobMovedParts();
    const [outcomeBefore, outcomeAfter] = names.outcomeParts();
    const moved = await scripts.trainRelocate.run(redis, {
      keys: { model: names.model(id), orphans: names.orphans(), held: names.gateHeld(id) },
      args: {
        modelId: id,
        expected: raw,
        record: JSON.stringify(next),
        bullPrefix: `${names.bull}:`,
        fromQueue: rec.train_queue,
        toQueue: this.o.queue,
        trainJobIdPrefix: jobIds.train(id, 0).slice(0, -1),
        otherJobIds: modelSideJobIds(id).join(' '),
        movedBefore,
        movedAfter,
        movedTtlS: outcomes.ttlS,
        outcomeBefore,
        outcomeAfter,
      },
    });
    if (moved === scripts.trainRelocate.codes.changed) {
      if (loaded) await this.o.adapter.unloadModel(id).catch(() => undefined);
      log.info('orphan settled elsewhere meanwhile', { model: id });
      return false;
    }
    if (loaded) engine.loaded.add(id);
    if (lost) {
      await snapshots.drop(id);
      log.warn('orphan could not come back; its ops fail with the reason', { model: id, from: rec.agent_id, reason: lost, moved });
      return false;
    }
    log.info('model adopted from a dead agent', { model: id, from: rec.agent_id, recovered: loaded, moved });
    return true;
  }
}
