import type { Redis } from 'ioredis';
import type { ApiConfig } from '../queues/config.js';
import type { OrderingGate } from '../queues/gate.js';
import type { Names } from '../queues/names.js';
import type { QueueSet } from '../queues/queues.js';
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
};
