import { Redis, type RedisOptions } from 'ioredis';

/**
 * Redis connections. BullMQ workers and the completion subscriber need `maxRetriesPerRequest: null`
 * (blocking commands, a subscription); producers give up on a command after a few reconnect attempts.
 */
export function connect(url: string, role: 'blocking' | 'producer', extra: RedisOptions = {}): Redis {
  return new Redis(url, {
    maxRetriesPerRequest: role === 'blocking' ? null : 3,
    lazyConnect: false,
    ...extra,
  });
}
