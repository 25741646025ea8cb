import { z } from 'zod';
import { RedisRegistry } from './store.js';

/**
 * What the registry keeps of futures beside their jobs: the futures refused before any job existed,
 * and the tenant that owns each future. Request ids are in queues/contract/futures.ts; answering a future is
 * api/futures.ts.
 */

export const FailedFuture = z.object({
  op: z.string(),
  category: z.enum(['user', 'server', 'unknown']),
  code: z.string().optional(),
  message: z.string(),
});
export type FailedFuture = z.infer<typeof FailedFuture>;

export class FutureRegistry extends RedisRegistry {
  /**
   * A future that failed before any job existed (its model was lost, its agent is gone): the
   * request still gets a future, as the SDK expects, and retrieving it reports the failure.
   */
  async putFailed(jobId: string, f: FailedFuture, ttlS: number): Promise<void> {
    await this.redis.set(this.names.failedFuture(jobId), JSON.stringify(f), 'EX', ttlS);
  }
  async getFailed(jobId: string): Promise<FailedFuture | null> {
    return this.getJson(this.names.failedFuture(jobId), FailedFuture);
  }
  /**
   * Records which tenant a future (`request_id`) belongs to. The first owner stays (a repeated
   * submission by the same tenant changes nothing); the record outlives the job's retention.
   */
  async setOwner(requestId: string, tenant: string, ttlS: number): Promise<void> {
    await this.redis.set(this.names.futureOwner(requestId), tenant, 'EX', ttlS, 'NX');
  }
  async owner(requestId: string): Promise<string | null> {
    return this.redis.get(this.names.futureOwner(requestId));
  }
}
