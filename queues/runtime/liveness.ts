import { Queue } from 'bullmq';
import type { Redis } from 'ioredis';
import { outcomeUnknownMessage } from '../contract/errors.js';
import type { Logger } from '../infra/logger.js';
import { removeAgentStats } from './metrics.js';
import { isModelJob, type Names } from '../contract/names.js';
import { Outcomes } from './outcomes.js';
import { AgentRecord, heartbeatMs } from '../registry/agents.js';
import type { ModelRegistry } from '../registry/models.js';
import { BEAT, scripts, type BeatResult } from './scripts.js';

/**
 * Agent liveness (docs/reliability.md). An agent holds its id through a liveness key whose value is
 * `<incarnation> <ms>` (a fresh incarnation per process start), rewritten every heartbeat
 * (timeout / 5) with a TTL of the agent's timeout. The key is the agent's identity:
 * - at start, an id whose key is being refreshed by another incarnation is refused (two stacks or two
 *   agents with one id on one Redis fail loudly instead of taking each other's jobs);
 * - a heartbeat that finds another incarnation holding the key stops the agent;
 * - a heartbeat also rewrites the agent's record, so an agent re-registers itself after Redis lost it;
 * - stopping deletes the key only while it is still this incarnation's; the record stays, so the
 *   reaper fails whatever is left queued on a stopped agent that is not coming back (a drained one
 *   is left alone while its drain record lasts).
 *
 * The reaper (run by every API process) fails the futures of an agent whose key has been gone for a
 * grace it observed itself with Redis answering (a Redis outage stops heartbeats and expiries alike,
 * so the key being gone just after Redis returns does not count): every queued and running op of the
 * agent fails with OUTCOME_UNKNOWN, its models are marked unavailable, its record is removed and a
 * `reaped` marker tells the agent, should it come back, that its models are gone.
 */
/** The reaper's own observation on top of the key's TTL: longer than an agent's reconnect backoff (1 s). */
export const REAP_GRACE_MIN_MS = 3_000;

export { heartbeatMs };

export { BEAT, type BeatResult };

export class Liveness {
  private readonly missingSince = new Map<string, number>();

  constructor(
    private readonly redis: Redis,
    private readonly names: Names,
    private readonly models: ModelRegistry,
    private readonly outcomes: Outcomes,
  ) {}

  // ---- agent side ----

  /**
   * Takes the agent id for this incarnation, or throws when another live process holds it: a key
   * that changes within one and a half of its holder's heartbeats is held; one that does not is a
   * dead agent's leftover and is taken over.
   */
  async claimId(rec: AgentRecord, incarnation: string, sleep = (ms: number) => new Promise((r) => setTimeout(r, ms))): Promise<void> {
    const key = this.names.agentAlive(rec.agent_id);
    const first = await this.redis.get(key);
    if (first !== null) {
      const holder = await this.agentRecord(rec.agent_id);
      const hb = heartbeatMs(holder?.timeout_s ?? 15);
      await sleep(Math.round(hb * 1.5) + 100);
      const second = await this.redis.get(key);
      if (second !== null && second !== first) {
        const who = holder ? ` by ${holder.host ?? '?'} pid ${holder.pid ?? '?'} since ${holder.started_at}` : '';
        throw new Error(
          `agent id '${rec.agent_id}' is alive elsewhere on this Redis (prefix '${this.names.prefix}')${who}: ` +
            `stop that agent, or give this one another TB_AGENT_ID (or another TB_PREFIX for a separate stack)`,
        );
      }
    }
    if ((await this.beat(rec, incarnation, true)) !== BEAT.ok) throw new Error(`agent id '${rec.agent_id}' could not be registered`);
  }

  /** Refreshes the liveness key and the agent's record (re-registering after Redis lost them). */
  async beat(rec: AgentRecord, incarnation: string, takeOver = false): Promise<BeatResult> {
    if (takeOver) await this.redis.del(this.names.agentAlive(rec.agent_id), this.names.agentReaped(rec.agent_id));
    const ttl = Math.round((rec.timeout_s ?? 30) * 1000);
    return scripts.livenessBeat.run(this.redis, {
      keys: { alive: this.names.agentAlive(rec.agent_id), reaped: this.names.agentReaped(rec.agent_id), agents: this.names.agents() },
      args: { incarnation, ttlMs: ttl, agentId: rec.agent_id, record: JSON.stringify(rec) },
    });
  }

  /** After a `reaped` heartbeat: the agent has dropped its models and comes back as alive. */
  async clearReaped(agentId: string, incarnation: string): Promise<void> {
    const key = this.names.agentReaped(agentId);
    if ((await this.redis.get(key))?.startsWith(`${incarnation} `)) await this.redis.del(key);
  }

  async release(agentId: string, incarnation: string): Promise<boolean> {
    const r = await scripts.livenessRelease.run(this.redis, { keys: { alive: this.names.agentAlive(agentId), agents: this.names.agents() }, args: { incarnation, agentId } });
    return r === scripts.livenessRelease.codes.released;
  }

  private async agentRecord(agentId: string): Promise<AgentRecord | null> {
    const raw = await this.redis.hget(this.names.agents(), agentId);
    if (raw === null) return null;
    const r = AgentRecord.safeParse(JSON.parse(raw));
    return r.success ? r.data : null;
  }

  // ---- API side ----

  /** Why the agent was reaped, or null when it was not. */
  async reapedWhy(agentId: string): Promise<string | null> {
    const v = await this.redis.get(this.names.agentReaped(agentId));
    return v === null ? null : v.slice(v.indexOf(' ') + 1);
  }

  /**
   * One pass of the reaper: agents without a liveness key for longer than a third of their timeout
   * or REAP_GRACE_MIN_MS (as observed here, on top of the key's own TTL, which is the timeout) are reaped. Returns the
   * agents reaped. A Redis error forgets every observation.
   */
  async sweep(log: Logger, now = Date.now()): Promise<string[]> {
    const reaped: string[] = [];
    try {
      const all = await this.redis.hgetall(this.names.agents());
      for (const [agentId, raw] of Object.entries(all)) {
        const parsed = AgentRecord.safeParse(JSON.parse(raw));
        if (!parsed.success) continue;
        const rec = parsed.data;
        if ((await this.redis.exists(this.names.agentAlive(agentId))) === 1 || (await this.redis.exists(this.names.agentDrained(agentId))) === 1) {
          this.missingSince.delete(agentId);
          continue;
        }
        const since = this.missingSince.get(agentId);
        if (since === undefined) {
          this.missingSince.set(agentId, now);
          continue;
        }
        if (now - since < Math.max(((rec.timeout_s ?? 30) * 1000) / 3, REAP_GRACE_MIN_MS)) continue;
        this.missingSince.delete(agentId);
        await this.reap(rec, log);
        reaped.push(agentId);
      }
    } catch (e) {
      this.missingSince.clear();
      log.debug('agent liveness sweep failed (Redis unreachable?)', { error: String(e) });
    }
    return reaped;
  }

  /**
   * Settles a dead agent. Its models, when it snapshotted them (its recovers marker), wait for a live
   * agent to adopt them (workers/agent/adoption.ts): the op that was running fails (OUTCOME_UNKNOWN),
   * the ops that never started are marked to move with the model and stay pending. Otherwise every
   * queued and running op fails (OUTCOME_UNKNOWN) and the models are marked unavailable.
   */
  async reap(rec: AgentRecord, log: Logger): Promise<void> {
    const agentId = rec.agent_id;
    const timeout = rec.timeout_s ?? 30;
    const why = `its worker agent '${agentId}' stopped answering (no heartbeat for over ${timeout} s)`;
    // The record's removal is the reap's claim: another API process's reaper that read it too does nothing.
    if ((await this.redis.hdel(this.names.agents(), agentId)) === 0) return;
    await this.redis.set(this.names.agentReaped(agentId), `${rec.incarnation ?? '?'} ${why}`, 'EX', 7 * 86_400);
    await removeAgentStats(this.redis, this.names, agentId);
    const recovers = (await this.redis.exists(this.names.agentRecovers(agentId))) === 1;
    const orphans = recovers ? await this.models.orphanOnAgent(agentId) : [];
    const lost = recovers ? [] : await this.models.markLostOnAgent(agentId, `${why}; load it from a saved checkpoint`);
    const orphanJob = (id: string) => orphans.some((m) => isModelJob(m.model_id, id));
    const moving = (await Promise.all(orphans.map((m) => this.redis.hvals(this.names.gateHeld(m.model_id))))).flat().map((v) => v.slice(v.indexOf(' ') + 1));
    const queue = new Queue(rec.train_queue, { connection: this.redis, prefix: this.names.bull });
    let failed = 0;
    try {
      for (const job of await queue.getJobs(['active', 'waiting', 'prioritized', 'delayed'])) {
        if (!job?.id) continue;
        // An orphan's op that never started moves with it (the one that was running has an outcome record).
        if (orphanJob(job.id) && (await this.outcomes.get(job.id)) === null) moving.push(job.id);
        else {
          await this.failPending(job.id, job.name, agentId, why);
          failed++;
        }
      }
    } finally {
      await queue.close();
    }
    for (const id of moving) await this.redis.set(this.names.jobMoved(id), 'pending', 'EX', this.outcomes.ttlS, 'NX');
    log.warn(
      recovers
        ? 'worker agent reaped: its running op failed (OUTCOME_UNKNOWN); its models wait for a live agent to adopt them from their snapshots'
        : 'worker agent reaped: its futures failed (OUTCOME_UNKNOWN), its models are unavailable',
      { agentId, models: recovers ? orphans.map((m) => m.model_id) : lost, futures: failed, moving: moving.length },
    );
  }

  /** Fails one pending op of a dead agent, unless its outcome is already final; returns the standing record. */
  failPending(jobId: string, op: string, agentId: string, why: string) {
    return this.outcomes.failUnknown(jobId, op, agentId, outcomeUnknownMessage(op, why));
  }
}
