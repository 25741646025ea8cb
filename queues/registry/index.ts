import type { Redis } from 'ioredis';
import type { Names } from '../contract/names.js';
import { AgentRegistry } from './agents.js';
import { CheckpointRegistry } from './checkpoints.js';
import { FutureRegistry } from './futures.js';
import { ModelRegistry } from './models.js';
import { SamplerRegistry } from './samplers.js';
import { SessionRegistry } from './sessions.js';

/**
 * The registries kept in Redis, one per concern; everything the API needs between two requests
 * lives in them, so API processes are stateless. Each key they use is built, with its lifetime, in
 * queues/contract/names.ts; the listing sweep that drops expired entries is queues/registry/listings.ts.
 */
export class Registry {
  /** Worker agents, the base models they serve, and sample routing. */
  readonly agents: AgentRegistry;
  /** Training models: placement, LoRA config, lost state, lifetimes, listings. */
  readonly models: ModelRegistry;
  /** Client sessions: heartbeats, what they created, finish records, listings. */
  readonly sessions: SessionRegistry;
  /** Sampling sessions and the models' inflight sampler targets. */
  readonly samplers: SamplerRegistry;
  /** Checkpoint records (training state, sampler versions, external weights). */
  readonly checkpoints: CheckpointRegistry;
  /** Futures refused before a job existed, and each future's owner. */
  readonly futures: FutureRegistry;

  constructor(
    readonly redis: Redis,
    readonly names: Names,
  ) {
    this.agents = new AgentRegistry(redis, names);
    this.models = new ModelRegistry(redis, names);
    this.checkpoints = new CheckpointRegistry(redis, names);
    this.sessions = new SessionRegistry(redis, names, this.checkpoints);
    this.samplers = new SamplerRegistry(redis, names);
    this.futures = new FutureRegistry(redis, names);
  }
}
