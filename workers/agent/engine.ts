import { DEFAULT_OP_TIMEOUTS_S, type AgentConfig } from '../../queues/infra/config.js';
import type { Logger } from '../../queues/infra/logger.js';
import { BrokerError, modelUnavailable } from '../../queues/contract/errors.js';
import type { ServedModel } from '../../queues/registry/agents.js';
import type { ModelRegistry } from '../../queues/registry/models.js';
import type { EngineAdapter } from '../adapters/adapter.js';
import type { EngineCapabilities } from '../adapters/registry.js';

/**
 * Engine supervision, for one agent. It owns:
 * - the engine's start, with the agent's base models loaded (`served`);
 * - its restart when it dies: ops wait for the new engine (`ensure`), which gets the models back from
 *   their snapshots (`recover`); the others are marked lost. A new engine that dies as it starts is
 *   started again (RESTART_TRIES in all) before the agent stops;
 * - its kill when an op runs past its time limit (`timed`, `TB_OP_TIMEOUTS`);
 * - the set of models that live in the current engine process (`loaded`).
 */

/** An op ran past its time limit: the engine was killed. */
export class OpTimeout extends Error {
  override readonly name = 'OpTimeout';
}

/** How many times a restart starts a new engine before the agent gives up and stops. */
export const RESTART_TRIES = 3;

export type EngineSupervisorOptions = {
  config: Pick<AgentConfig, 'agentId' | 'models' | 'engineRestart' | 'opTimeoutsS'>;
  log: Logger;
  adapter: EngineAdapter;
  capabilities: Pick<EngineCapabilities, 'trains'>;
  /** The models' records: lost models are marked there, and a model not loaded here says why. */
  models: Pick<ModelRegistry, 'markLostOnAgent' | 'get'>;
  /** Whether the agent is stopping: an engine exit then is expected. */
  stopping: () => boolean;
  /** Stops the agent (the engine could not be restarted). */
  stop: () => void;
  /** Loads the models of a dead engine into the new one (their snapshots); returns those that came back, marks the others lost with `why`. */
  recover?: (modelIds: string[], why: string) => Promise<Set<string>>;
};

export class EngineSupervisor {
  /** The base models of the current engine, as the agent publishes them. */
  served: ServedModel[] = [];
  /** Models whose adapters live in the current engine process. */
  readonly loaded = new Set<string>();
  /** Set while the engine restarts: jobs taken meanwhile wait for it. */
  restarting: Promise<void> | null = null;
  /** Incremented when the engine dies: an op that saw it change does not know its outcome. */
  epoch = 0;
  /** Why the agent killed its engine (an op past its time limit), for the models' lost reason. */
  private killReason: string | null = null;
  /** Set from an engine's death until its restart has ended (`restarting` is assigned a moment later). */
  private inRestart = false;
  /** The wait before a restart's second start (then twice that, …). */
  restartBackoffMs = 1_000;

  constructor(private readonly o: EngineSupervisorOptions) {
    o.adapter.onExit((reason) => this.onExit(reason));
  }

  /** Starts the engine and loads the agent's base models. A model is trainable only on an engine that trains. */
  async start(): Promise<void> {
    const { adapter, config, capabilities } = this.o;
    await adapter.start();
    this.served = [];
    for (const spec of config.models) {
      // The tokenizer is the preset's, whatever the engine (get_info's tokenizer_id).
      const m = { ...(await adapter.loadBase(spec)), ...(spec.tokenizer ? { tokenizer: spec.tokenizer } : {}) };
      this.served.push(capabilities.trains ? m : { ...m, trainable: false });
    }
  }

  private onExit(exitReason: string): void {
    if (this.o.stopping()) return;
    const { config, log } = this.o;
    this.epoch++;
    // The engine being started by a restart died: that start fails, and the restart tries again.
    if (this.inRestart) {
      log.error('engine process died while restarting', { reason: exitReason });
      return;
    }
    const reason = this.killReason ?? exitReason;
    this.killReason = null;
    log.error('engine process died', { reason });
    const models = [...this.loaded];
    this.loaded.clear();
    // Set synchronously, so a job taken from now on waits for the new engine.
    this.inRestart = true;
    this.restarting = (async () => {
      let recovered = new Set<string>();
      try {
        if (!config.engineRestart) throw new Error('engine restart is disabled (TB_ENGINE_RESTART=false)');
        await this.startWithRetries();
        if (this.o.recover && models.length) recovered = await this.o.recover(models, reason);
        for (const m of recovered) this.loaded.add(m);
        log.info('engine restarted', recovered.size ? { recovered: [...recovered] } : {});
      } catch (e) {
        log.error('engine not restarted; agent stopping', { error: String(e) });
        process.exitCode = 1;
        this.o.stop();
      } finally {
        // Every other model placed here is lost: its ops fail with the reason from now on.
        await this.o.models.markLostOnAgent(config.agentId, `${reason}; load it from a saved checkpoint`, recovered).catch((e) => log.error('models not marked lost', { error: String(e) }));
        const lost = models.filter((m) => !recovered.has(m));
        if (lost.length) log.warn('models lost with the engine', { models: lost });
        this.restarting = null;
        this.inRestart = false;
      }
    })();
  }

  /**
   * A restart's start: tried RESTART_TRIES times, a second more apart each time (the new engine may
   * die as it starts: an OOM kill while the old one's memory is freed, a node under pressure).
   */
  private async startWithRetries(): Promise<void> {
    for (let attempt = 1; ; attempt++) {
      try {
        await this.start();
        return;
      } catch (e) {
        if (attempt >= RESTART_TRIES || this.o.stopping()) throw e;
        this.o.log.warn('engine restart failed; trying again', { attempt, of: RESTART_TRIES, error: String(e) });
        await new Promise((r) => setTimeout(r, this.restartBackoffMs * attempt));
      }
    }
  }

  /** Waits for a restart under way, if any. */
  async ensure(): Promise<void> {
    if (this.restarting) await this.restarting;
  }

  /** Throws UNAVAILABLE, with the model record's lost reason, unless the model lives in this engine. */
  async requireLoaded(modelId: string): Promise<void> {
    if (this.loaded.has(modelId)) return;
    const rec = await this.o.models.get(modelId);
    const why = rec?.lost_reason ?? 'it is not loaded on this agent';
    throw new BrokerError('UNAVAILABLE', modelUnavailable(modelId, why));
  }

  /** Rejects with OpTimeout and kills the engine (a hung engine) when the op runs past its limit. */
  timed<T>(op: string, p: Promise<T>): Promise<T> {
    const limitS = this.o.config.opTimeoutsS?.[op] ?? DEFAULT_OP_TIMEOUTS_S[op] ?? 1800;
    let timer: NodeJS.Timeout | undefined;
    const timeout = new Promise<never>((_, reject) => {
      timer = setTimeout(() => {
        const why = `${op} ran past its time limit of ${limitS} s (TB_OP_TIMEOUTS); the agent killed its engine as hung`;
        this.o.log.error('op timed out; killing the engine', { op, limitS });
        this.killReason = why;
        this.o.adapter.kill?.();
        reject(new OpTimeout(why));
      }, limitS * 1000);
    });
    return Promise.race([p, timeout]).finally(() => clearTimeout(timer));
  }
}
