import type { Redis } from 'ioredis';
import type { ApiConfig } from '../queues/infra/config.js';
import type { OrderingGate } from '../queues/runtime/gate.js';
import type { Names } from '../queues/contract/names.js';
import type { QueueSet } from '../queues/runtime/queues.js';
import type { Registry } from '../queues/registry/index.js';
import type { FutureResolver } from './futures.js';

/** What every route needs: configuration and the Redis-backed state. Built by `buildApp`. */
export type ApiContext = {
  config: ApiConfig;
  redis: Redis;
  names: Names;
  registry: Registry;
  queues: QueueSet;
  gate: OrderingGate;
  futures: FutureResolver;
  /**
   * Whether the worker agents started in this process (the start command's node) are ready; absent
   * when none run here. Until then /healthz says starting: after a crash and a quick restart the dead
   * process's agent still looks live in Redis for up to its timeout.
   */
  localAgentsReady?: () => boolean;
};
