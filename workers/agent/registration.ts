import type { Redis } from 'ioredis';
import type { AgentConfig } from '../../queues/infra/config.js';
import type { Logger } from '../../queues/infra/logger.js';
import type { Names } from '../../queues/contract/names.js';
import { BEAT, heartbeatMs, type BeatResult, type Liveness } from '../../queues/runtime/liveness.js';
import { publishAgentStats, removeAgentStats, type AgentStats } from '../../queues/runtime/metrics.js';
import type { AgentRecord } from '../../queues/registry/agents.js';
import type { Registry } from '../../queues/registry/index.js';
import type { EngineAdapter } from '../adapters/adapter.js';
import { engineMemory } from '../stats.js';
import type { EngineSupervisor } from './engine.js';

/**
 * Registration and liveness of one agent: its record in Redis (what it serves and what its engine
 * can do), the claim of its agent id against a second process, the heartbeat that keeps both and its
 * models' records alive, what a beat learns (reaped: drop the models and register again; id taken:
 * stop; a drain asked through Redis), and the engine's memory published beside the record.
 */

export type RegistrationOptions = {
  config: Pick<AgentConfig, 'agentId' | 'retentionS'>;
  log: Logger;
  names: Names;
  redis: Redis;
  registry: Registry;
  liveness: Liveness;
  adapter: EngineAdapter;
  engine: EngineSupervisor;
  incarnation: string;
  /** Liveness timeout in seconds. */
  timeoutS: number;
  /** The record as the agent starts (no models yet). */
  record: AgentRecord;
  stopping: () => boolean;
  /** A drain was asked for (`tinker-broker drain`). */
  drain: () => void;
  /** Another process holds this agent id now. */
  stop: () => void;
  /** After each heartbeat that found the agent registered (its errors are its own). */
  afterBeat?: () => Promise<void>;
};

export class Registration {
  record: AgentRecord;
  /** Set once the agent id is this process's: heartbeats start then. */
  registered = false;
  private heartbeat: NodeJS.Timeout | undefined;
  /** When a beat last found this agent holding its id (ms). */
  private lastOkAt = Date.now();
  /** After this agent learnt it was reaped: what follows its next beat (its models taken back), until done. */
  private recovering: Promise<void> | null = null;

  constructor(private readonly o: RegistrationOptions) {
    this.record = o.record;
  }

  /**
   * Claims the agent id (a second process with this id stops here, before it touches the first one's
   * models or jobs), then beats every fifth of the timeout, and at once when Redis is back (restarted,
   * failed over), re-registering if it lost the record.
   */
  async claim(): Promise<void> {
    await this.o.liveness.claimId(this.record, this.o.incarnation);
    this.registered = true;
    this.heartbeat = setInterval(() => {
      void this.beat();
      void this.publishStats();
    }, heartbeatMs(this.o.timeoutS));
    this.o.redis.on('ready', () => void this.beat());
  }

  /** The record with what the agent serves, once its engine is up (published from the next beat). */
  serve(models: AgentRecord['models'], device: string): void {
    this.record = { ...this.record, models, device };
  }

  /**
   * One heartbeat: refreshes the liveness key and the record. A reaped agent (it was silent past
   * its timeout) drops its models, which were reported unavailable, and registers again; an agent
   * whose id another process holds now stops.
   */
  async beat(): Promise<BeatResult | 'error'> {
    const { liveness, config, log, engine, incarnation } = this.o;
    if (this.o.stopping() || !this.registered) return 'error';
    try {
      let r = await liveness.beat(this.record, incarnation);
      let reaped = false;
      if (r === BEAT.reaped) {
        reaped = true;
        const models = [...engine.loaded];
        engine.loaded.clear();
        log.warn('this agent was reaped (silent past its timeout): its models are dropped (those with a snapshot wait for adoption, here or on another agent)', { models });
        for (const m of models) await this.o.adapter.unloadModel(m).catch(() => undefined);
        await liveness.clearReaped(config.agentId, incarnation);
        r = await liveness.beat(this.record, incarnation);
      }
      if (r === BEAT.ok) this.lastOkAt = Date.now();
      // The models loaded here are in use: their records never expire while this agent lives (queues/contract/names.ts),
      // at least five heartbeats ahead however short the retention.
      if (r === BEAT.ok) await this.o.registry.models.keep(engine.loaded, Math.max(config.retentionS, this.o.timeoutS));
      if (r === BEAT.ok && this.o.afterBeat) {
        const after = this.o.afterBeat();
        if (reaped) this.recovering = after.finally(() => (this.recovering = null));
      }
      if (r === BEAT.ok && (await this.o.redis.getdel(this.o.names.agentDrainRequest(config.agentId))) !== null) {
        log.info('drain requested (tinker-broker drain)');
        this.o.drain();
      }
      if (r === BEAT.taken) {
        log.error('another process registered this agent id; stopping', { agentId: config.agentId });
        process.exitCode = 1;
        this.o.stop();
      }
      return r;
    } catch (e) {
      log.warn('heartbeat failed', { error: String(e) });
      return 'error';
    }
  }

  /**
   * Before a training op is claimed: after a pause longer than the liveness timeout (the process was
   * stopped, a long GC), one heartbeat first, and what follows it. A reaped agent so learns it
   * before it runs an op on a model the reaper gave up, and takes its models back from their
   * snapshots (workers/agent/adoption.ts) unless another agent has them. Otherwise nothing to wait
   * for: undefined, so the caller does not yield to the event loop.
   */
  ensureFresh(): Promise<void> | undefined {
    const stale = Date.now() - this.lastOkAt > this.o.timeoutS * 1000;
    if (!stale && !this.recovering) return undefined;
    return (async () => {
      if (stale) await this.beat();
      if (this.recovering) await this.recovering;
    })();
  }

  /** Engine memory for /metrics and `tinker-broker agents`; a failure to read it is not an error of the agent. */
  async publishStats(): Promise<void> {
    if (!this.registered || this.o.stopping()) return;
    const { adapter } = this.o;
    try {
      const mem = await engineMemory(adapter.enginePids?.() ?? [], adapter.device.startsWith('cuda'));
      await publishAgentStats(this.o.redis, this.o.names, {
        agent_id: this.o.config.agentId,
        engine: adapter.kind,
        device: adapter.device,
        engine_rss_bytes: mem.rss,
        gpu_memory_bytes: mem.gpu,
        ...gpuTurnStats(adapter),
        updated_at: new Date().toISOString(),
      });
    } catch (e) {
      this.o.log.debug('engine stats not published', { error: String(e) });
    }
  }

  /** Stops the heartbeat (the agent is stopping). */
  stopBeating(): void {
    clearInterval(this.heartbeat);
  }

  /** Gives the agent id up (the reaper then has nothing to do) and removes the published stats. */
  async release(): Promise<void> {
    await this.o.liveness.release(this.o.config.agentId, this.o.incarnation).catch(() => undefined);
    await removeAgentStats(this.o.redis, this.o.names, this.o.config.agentId).catch(() => undefined);
  }
}

/** The GPU turns of an adapter that takes them, as its published stats hold them. */
function gpuTurnStats(adapter: EngineAdapter): Partial<Pick<AgentStats, 'gpu_turns'>> {
  const t = adapter.turns?.();
  return t ? { gpu_turns: { taken: t.taken, given: t.given, acquire_ms: t.acquireMs, release_ms: t.releaseMs, wait_ms: t.waitMs, held_ms: t.heldMs, holding: t.holding } } : {};
}
