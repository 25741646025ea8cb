import type { Redis } from 'ioredis';
import type { z } from 'zod';
import type { Names } from '../contract/names.js';

/** What every registry stands on: the Redis connection, the key names, and JSON records read through their schema. */
export abstract class RedisRegistry {
  constructor(
    protected readonly redis: Redis,
    protected readonly names: Names,
  ) {}

  /** The record at `key`, parsed against its schema, or null when there is none. */
  protected async getJson<T>(key: string, schema: z.ZodType<T>): Promise<T | null> {
    const raw = await this.redis.get(key);
    return raw === null ? null : schema.parse(JSON.parse(raw));
  }
  /** Stores `rec` at `key` for `ttlS` unless a record is there already; returns the stored one. */
  protected async putJsonIfAbsent<T>(key: string, rec: T, ttlS: number, schema: z.ZodType<T>): Promise<T> {
    const ok = await this.redis.set(key, JSON.stringify(rec), 'EX', ttlS, 'NX');
    if (ok === 'OK') return rec;
    return (await this.getJson(key, schema))!;
  }
}
