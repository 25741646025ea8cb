import type { Redis } from 'ioredis';
import type { Logger } from '../queues/infra/logger.js';
import type { Names } from '../queues/contract/names.js';
import type { EngineAdapter } from './adapters/adapter.js';

/**
 * GPU turns: agents that share one GPU and take turns on it (a preset's agents with `take_turns`
 * on the same GPU of a node) hand the GPU to the phase that runs. One agent at a time holds the
 * GPU's turn; it runs its GPU work (training ops, sample requests) only while it holds it.
 *
 * - The turn is a Redis key with the holder's agent id and a lease (`leaseMs`), renewed while held:
 *   a holder that dies loses its turn within the lease.
 * - An agent with work and no turn asks for it (the GPU's waiting set) and takes it once the key is
 *   free and no agent has waited longer (first come, first served). Taking it runs the engine's `acquire` hook (vLLM: wake up from sleep mode).
 * - The holder gives the turn up only when another agent waits and it has nothing in flight, after
 *   `graceMs` without work (the ops of one phase come in bursts: forward_backward then optim_step, a
 *   burst of samples): first its `release` hook (vLLM: sleep, its weights to CPU memory and its KV
 *   cache dropped; torch: its allocator's cached blocks given back to the device), then the key.
 * - Bounded waiting: once its turn has lasted `maxTurnMs` while another agent waits, the holder
 *   starts no new work until it has handed the turn over, so a steady stream of one phase's work
 *   cannot starve the other.
 * - An agent alone, or with nobody waiting, keeps the turn: no switch is paid when nothing needs it.
 *
 * The decisions are made here, by each agent from its own work and the waiting set; no process
 * coordinates them. docs/architecture.md, "One GPU, several engines", has the design and its limits.
 */

export type TurnHooks = {
  /** Runs after the turn is taken, before the agent's work (vLLM: wake_up). */
  acquire(): Promise<void>;
  /** Runs before the turn is handed over, after the agent's work (vLLM: sleep; torch: empty its allocator's cache). */
  release(): Promise<void>;
};

export type GpuTurnsOptions = {
  names: Names;
  /** The shared GPU, `<node>/<index>` (one key per GPU of a node). */
  gpu: string;
  agentId: string;
  log: Logger;
  /** How long a turn lasts without renewal (a dead holder's turn ends after this). @defaultValue 10000 */
  leaseMs?: number;
  /** Idle time before the holder hands the turn to a waiting agent. @defaultValue 20 */
  graceMs?: number;
  /** Longest turn while another agent waits. @defaultValue 30000 */
  maxTurnMs?: number;
  /** How often a waiting agent tries for the turn, and the holder looks for waiting agents. @defaultValue 10 */
  pollMs?: number;
};

export type TurnStats = {
  /** Turns this agent took. */
  taken: number;
  /** Turns it handed over. */
  given: number;
  /** Time in the acquire hook (waking), in the release hook (sleeping), waiting for the turn, holding it: ms, summed. */
  acquireMs: number;
  releaseMs: number;
  waitMs: number;
  heldMs: number;
  /** Whether it holds the turn now. */
  holding: boolean;
};

/** Deletes the turn key only if this agent holds it. */
const RELEASE_LUA = `if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('del', KEYS[1]) else return 0 end`;
/** Renews the turn's lease only if this agent holds it; 0 when it lost it. */
const RENEW_LUA = `if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('pexpire', KEYS[1], ARGV[2]) else return 0 end`;
/**
 * An ask for the turn, first come first served: the waiting set keeps each agent's first ask (its
 * score, by Redis's clock, so hosts' clocks need not agree), the asks set its latest; an agent that
 * stopped asking (its latest ask older than ARGV[3] ms) leaves both. A free turn goes to the earliest
 * asker only, so an agent that just handed the turn over cannot take it back before the agent it
 * handed it to. Returns the holder after the ask (this agent if it took the turn).
 * KEYS: holder, wants, asks; ARGV: agent id, lease ms, ask freshness ms.
 */
const ASK_LUA = `
if redis.call('get', KEYS[1]) == ARGV[1] then
  redis.call('zrem', KEYS[2], ARGV[1])
  redis.call('zrem', KEYS[3], ARGV[1])
  return ARGV[1]
end
local t = redis.call('time')
local now = t[1] * 1000 + math.floor(t[2] / 1000)
redis.call('zadd', KEYS[2], 'NX', now, ARGV[1])
redis.call('zadd', KEYS[3], now, ARGV[1])
for _, k in ipairs({KEYS[2], KEYS[3]}) do redis.call('pexpire', k, ARGV[2]) end
for _, gone in ipairs(redis.call('zrangebyscore', KEYS[3], '-inf', now - tonumber(ARGV[3]))) do
  redis.call('zrem', KEYS[2], gone)
  redis.call('zrem', KEYS[3], gone)
end
if not redis.call('get', KEYS[1]) then
  local first = redis.call('zrange', KEYS[2], 0, 0)[1]
  if first == ARGV[1] then
    redis.call('set', KEYS[1], ARGV[1], 'PX', ARGV[2])
    redis.call('zrem', KEYS[2], ARGV[1])
    redis.call('zrem', KEYS[3], ARGV[1])
  end
end
return redis.call('get', KEYS[1])`;
/** The agents asking for the turn now (stale asks dropped). KEYS: wants, asks; ARGV: ask freshness ms. */
const ASKING_LUA = `
local t = redis.call('time')
local now = t[1] * 1000 + math.floor(t[2] / 1000)
for _, gone in ipairs(redis.call('zrangebyscore', KEYS[2], '-inf', now - tonumber(ARGV[1]))) do
  redis.call('zrem', KEYS[1], gone)
  redis.call('zrem', KEYS[2], gone)
end
return redis.call('zrange', KEYS[1], 0, -1)`;

export class GpuTurns {
  private readonly leaseMs: number;
  private readonly graceMs: number;
  private readonly maxTurnMs: number;
  private readonly pollMs: number;
  /** An ask counts this long (a waiting agent renews its ask every `pollMs`). */
  private readonly askFreshMs: number;
  private readonly holderKey: string;
  private readonly wantsKey: string;
  private readonly asksKey: string;
  private hooks: TurnHooks = { acquire: async () => undefined, release: async () => undefined };
  private redisConn: Redis | null = null;

  private held = false;
  /** A hand-over or a take in progress: new work waits for it. */
  private switching: Promise<void> | null = null;
  private inflight = 0;
  private waiting = 0;
  private turnStart = 0;
  private lastActive = 0;
  /** Whether another agent asked for the turn within the lease (refreshed by the watch loop). */
  private othersWait = false;
  private watch: NodeJS.Timeout | null = null;
  private closed = false;
  private readonly wakers = new Set<() => void>();
  private readonly s: TurnStats = { taken: 0, given: 0, acquireMs: 0, releaseMs: 0, waitMs: 0, heldMs: 0, holding: false };

  constructor(private readonly o: GpuTurnsOptions) {
    this.leaseMs = o.leaseMs ?? 10_000;
    this.graceMs = o.graceMs ?? 20;
    this.maxTurnMs = o.maxTurnMs ?? 30_000;
    this.pollMs = o.pollMs ?? 10;
    this.askFreshMs = Math.max(250, 25 * this.pollMs);
    this.holderKey = o.names.gpuTurnHolder(o.gpu);
    this.wantsKey = o.names.gpuTurnWants(o.gpu);
    this.asksKey = o.names.gpuTurnAsks(o.gpu);
  }

  /** The agent's Redis connection (set as the agent starts, before any work). */
  attach(redis: Redis): void {
    this.redisConn = redis;
  }

  private get redis(): Redis {
    if (!this.redisConn) throw new Error('GPU turns: no Redis connection attached');
    return this.redisConn;
  }

  /** The engine's hooks (set once the engine adapter exists). */
  setHooks(hooks: TurnHooks): void {
    this.hooks = hooks;
  }

  stats(): TurnStats {
    const heldNow = this.held ? Date.now() - this.turnStart : 0;
    return { ...this.s, heldMs: this.s.heldMs + heldNow, holding: this.held };
  }

  /** Runs `f` while this agent holds the GPU's turn (taking it first if needed). */
  async run<T>(f: () => Promise<T>): Promise<T> {
    if (this.closed) return f();
    this.waiting++;
    try {
      await this.enter();
    } finally {
      this.waiting--;
    }
    this.inflight++;
    try {
      return await f();
    } finally {
      this.inflight--;
      this.lastActive = Date.now();
      this.wake();
    }
  }

  /** Waits until this agent holds the turn and may start work on it. */
  private async enter(): Promise<void> {
    const t0 = Date.now();
    for (;;) {
      if (this.switching) {
        await this.switching;
        continue;
      }
      if (this.held) {
        // A turn past its bound while another agent waits starts nothing new: it ends once its work is done.
        if (!(this.othersWait && Date.now() - this.turnStart >= this.maxTurnMs)) break;
        await this.next(this.pollMs);
        continue;
      }
      if (await this.tryTake()) break;
      await this.next(this.pollMs);
    }
    this.s.waitMs += Date.now() - t0;
    this.ensureWatch();
  }

  /** One attempt at the turn: asks for it (the waiting set) and takes the key if it is free. */
  private async tryTake(): Promise<boolean> {
    const { redis } = this;
    const { agentId } = this.o;
    // The holder after the ask: this agent when the turn was free (or still its own from a previous start of this agent id).
    const holder = await redis.eval(ASK_LUA, 3, this.holderKey, this.wantsKey, this.asksKey, agentId, String(this.leaseMs), String(this.askFreshMs));
    if (holder !== agentId) return false;
    if (this.switching || this.held) return false; // another caller of this agent took it meanwhile
    let done!: () => void;
    this.switching = new Promise<void>((r) => (done = r));
    try {
      const a0 = Date.now();
      try {
        await this.hooks.acquire();
      } catch (e) {
        // The engine could not take the GPU (its server is down, say): the turn goes back, the work fails.
        await redis.eval(RELEASE_LUA, 1, this.holderKey, agentId).catch(() => undefined);
        throw e;
      }
      this.s.acquireMs += Date.now() - a0;
      this.s.taken++;
      this.held = true;
      this.turnStart = Date.now();
      this.lastActive = this.turnStart;
      this.o.log.info('gpu turn taken', { gpu: this.o.gpu, wake_ms: Date.now() - a0, taken: this.s.taken });
      return true;
    } finally {
      this.switching = null;
      done();
      this.wake();
    }
  }

  /** The holder's loop: renews the lease, looks for waiting agents, hands the turn over when it should. */
  private ensureWatch(): void {
    if (this.watch || this.closed) return;
    let lastRenew = 0;
    const tick = async () => {
      if (this.closed) return;
      const { redis } = this;
    const { agentId } = this.o;
      try {
        const now = Date.now();
        if (this.held && now - lastRenew >= this.leaseMs / 4) {
          lastRenew = now;
          if (!(await redis.eval(RENEW_LUA, 1, this.holderKey, agentId, String(this.leaseMs)))) {
            // The lease ran out (this process stalled past it): whatever runs now runs without the turn.
            this.o.log.warn('gpu turn lost (its lease ran out); taking it again for the next work', { gpu: this.o.gpu });
            this.endTurn();
          }
        }
        if (this.held) {
          const asking = (await redis.eval(ASKING_LUA, 2, this.wantsKey, this.asksKey, String(this.askFreshMs))) as string[];
          this.othersWait = asking.some((a) => a !== agentId);
          if (this.shouldHandOver()) await this.handOver();
        }
      } catch (e) {
        this.o.log.debug('gpu turn check failed', { gpu: this.o.gpu, error: String(e) });
      }
      if (!this.closed) this.watch = setTimeout(() => void tick(), this.pollMs);
    };
    this.watch = setTimeout(() => void tick(), this.pollMs);
  }

  private shouldHandOver(): boolean {
    if (!this.held || this.switching || this.inflight > 0 || !this.othersWait) return false;
    const overdue = Date.now() - this.turnStart >= this.maxTurnMs;
    return overdue || (this.waiting === 0 && Date.now() - this.lastActive >= this.graceMs);
  }

  private async handOver(): Promise<void> {
    let done!: () => void;
    this.switching = new Promise<void>((r) => (done = r));
    const r0 = Date.now();
    try {
      try {
        await this.hooks.release();
      } catch (e) {
        // A failed release still hands the turn over: the other agent's own start then says what is short.
        this.o.log.warn('gpu turn: the engine did not give its memory back', { gpu: this.o.gpu, error: String(e) });
      }
      const sleepMs = Date.now() - r0;
      this.s.releaseMs += sleepMs;
      this.s.given++;
      const heldMs = Date.now() - this.turnStart;
      this.endTurn();
      await this.redis.eval(RELEASE_LUA, 1, this.holderKey, this.o.agentId);
      this.o.log.info('gpu turn given', { gpu: this.o.gpu, held_ms: heldMs, sleep_ms: sleepMs, given: this.s.given });
    } finally {
      this.switching = null;
      done();
      this.wake();
    }
  }

  private endTurn(): void {
    if (this.held) this.s.heldMs += Date.now() - this.turnStart;
    this.held = false;
    this.othersWait = false;
  }

  private next(ms: number): Promise<void> {
    return new Promise<void>((resolve) => {
      const done = () => {
        clearTimeout(t);
        this.wakers.delete(done);
        resolve();
      };
      const t = setTimeout(done, ms);
      this.wakers.add(done);
    });
  }

  private wake(): void {
    for (const w of [...this.wakers]) w();
  }

  /** Stops taking part: the turn, if held, is handed back at once (without the release hook: the engine is stopping). */
  async close(): Promise<void> {
    this.closed = true;
    if (this.watch) clearTimeout(this.watch);
    this.watch = null;
    this.endTurn();
    this.wake();
    const redis = this.redisConn;
    if (!redis) return;
    const { agentId } = this.o;
    await redis.eval(RELEASE_LUA, 1, this.holderKey, agentId).catch(() => undefined);
    await redis.multi().zrem(this.wantsKey, agentId).zrem(this.asksKey, agentId).exec().catch(() => undefined);
  }
}

/**
 * `inner` with its GPU work run inside `turns`: loading a base, creating a model, training ops,
 * loading a training state, snapshots (a copy on the GPU first) and sampling take the turn first.
 * Saving sampler weights and states only reads what is already on the GPU, so it runs in any phase:
 * publishing new sampler weights does not wait for the trainer's next turn. The engine's hooks come from the adapter's
 * `releaseGpu` / `reclaimGpu`.
 */
export function takingTurns(inner: EngineAdapter, turns: GpuTurns): EngineAdapter {
  turns.setHooks({
    acquire: () => inner.reclaimGpu?.() ?? Promise.resolve(),
    release: () => inner.releaseGpu?.() ?? Promise.resolve(),
  });
  const t = <A extends unknown[], R>(f: (...a: A) => Promise<R>) => (...a: A) => turns.run(() => f(...a));
  const wrapped: EngineAdapter = {
    kind: inner.kind,
    // The engine reports its device as it starts (torch: cuda:N from its hello).
    get device() {
      return inner.device;
    },
    get sampleLacks() {
      return inner.sampleLacks;
    },
    start: () => inner.start(),
    stop: async () => {
      await turns.close();
      await inner.stop();
    },
    loadBase: t((spec) => inner.loadBase(spec)),
    createModel: t((job) => inner.createModel(job)),
    forwardBackward: t((job) => inner.forwardBackward(job)),
    optimStep: t((job) => inner.optimStep(job)),
    saveSampler: (job) => inner.saveSampler(job),
    saveState: (...a) => inner.saveState(...a),
    loadState: t((...a: Parameters<EngineAdapter['loadState']>) => inner.loadState(...a)),
    unloadModel: (id) => inner.unloadModel(id),
    sample: t((job) => inner.sample(job)),
    onExit: (l) => inner.onExit(l),
    turns: () => turns.stats(),
  };
  if (inner.forwardBackwardGroup) wrapped.forwardBackwardGroup = t((jobs) => inner.forwardBackwardGroup!(jobs));
  if (inner.sampleBatch) wrapped.sampleBatch = t((jobs) => inner.sampleBatch!(jobs));
  // A snapshot copies the adapter and its AdamW moments on the GPU before writing them: in the turn.
  if (inner.snapshot) wrapped.snapshot = t((...a: Parameters<NonNullable<EngineAdapter['snapshot']>>) => inner.snapshot!(...a));
  if (inner.kill) wrapped.kill = () => inner.kill!();
  if (inner.enginePids) wrapped.enginePids = () => inner.enginePids!();
  return wrapped;
}
