import { createHash } from 'node:crypto';

/**
 * Every queue name and Redis key of a deployment, in one place. `prefix` isolates
 * deployments (and tests) that share one Redis.
 */
export function shortHash(s: string, n = 16): string {
  return createHash('sha1').update(s).digest('hex').slice(0, n);
}

export class Names {
  constructor(readonly prefix: string) {}

  /** BullMQ prefix for all queues of this deployment. */
  get bull(): string {
    return `${this.prefix}-bull`;
  }
  /** Training ops of the models placed on one agent, run one at a time. */
  trainQueue(agentId: string): string {
    return `train-${agentId}`;
  }
  /**
   * Sample jobs for one base model on one kind of engine, taken by every agent of that engine serving
   * it. The API picks the engine of each job (`sampleEngine` in queues/registry.ts).
   */
  sampleQueue(baseModel: string, engine: string): string {
    return `sample-${shortHash(baseModel, 12)}-${engine}`;
  }

  // Registries.
  agents(): string {
    return `${this.prefix}:agents`;
  }
  /** `<incarnation> <ms>`, TTL the agent's timeout, refreshed every heartbeat (queues/liveness.ts). */
  agentAlive(agentId: string): string {
    return `${this.prefix}:agent:${agentId}:alive`;
  }
  /** Why the reaper declared the agent dead (kept 7 days; the agent reads it at its next heartbeat). */
  agentReaped(agentId: string): string {
    return `${this.prefix}:agent:${agentId}:reaped`;
  }
  /** The models a drained agent saved for its next start (TTL TB_DRAIN_KEEP_S; while it exists, the agent is not reaped). */
  agentDrained(agentId: string): string {
    return `${this.prefix}:agent:${agentId}:drained`;
  }
  /** Set by `tinker-broker drain` (TTL the drain's timeout); the agent's next heartbeat takes it and drains. */
  agentDrainRequest(agentId: string): string {
    return `${this.prefix}:agent:${agentId}:drain-request`;
  }
  session(sessionId: string): string {
    return `${this.prefix}:session:${sessionId}`;
  }
  /** A tenant's listing of its sessions, models (training runs) or checkpoints (sorted sets by time). */
  tenantIndex(tenant: string, what: 'sessions' | 'models' | 'ckpts'): string {
    return `${this.prefix}:tenant:${tenant}:${what}`;
  }
  /** The tenant that owns a future, by `request_id`. */
  futureOwner(requestId: string): string {
    return `${this.prefix}:future-owner:${requestId}`;
  }
  model(modelId: string): string {
    return `${this.prefix}:model:${modelId}`;
  }
  samplingSession(id: string): string {
    return `${this.prefix}:sampler:${id}`;
  }
  /** A training model's inflight sampler target (its newest `kind: inflight` save). */
  inflight(modelId: string): string {
    return `${this.prefix}:inflight:${modelId}`;
  }
  /** What stable_reinforce needs of one sampled sequence (queues/stability.ts). */
  stability(sequenceId: string): string {
    return `${this.prefix}:stability:${sequenceId}`;
  }

  // The per-model ordering gate (see queues/gate.ts).
  gateNext(modelId: string): string {
    return `${this.prefix}:gate:${modelId}:next`;
  }
  gateHeld(modelId: string): string {
    return `${this.prefix}:gate:${modelId}:held`;
  }
  /** Replay digests of a model's recent seq_ids (expire `window` seq_ids back, or with the key's TTL). */
  gateDigests(modelId: string): string {
    return `${this.prefix}:gate:${modelId}:digests`;
  }
  /** Job id -> model of every held op (entries leave when released or failed). */
  gateHeldIndex(): string {
    return `${this.prefix}:gate:held-index`;
  }
  /** Models with ops waiting behind a gap, scored by when the wait times out. */
  gateGaps(): string {
    return `${this.prefix}:gate:gaps`;
  }
  /** Each model's last training request (ISO time), shown in listings. */
  modelLast(): string {
    return `${this.prefix}:model-last`;
  }
  /** A future that failed before its job ran (kept for the retention). */
  failedFuture(jobId: string): string {
    return `${this.prefix}:failed-future:${jobId}`;
  }
  /** A training op's outcome record (queues/outcomes.ts; kept for the retention, shortly once read). */
  outcome(jobId: string): string {
    return `${this.prefix}:outcome:${jobId}`;
  }
  /** Pub/sub channel: the job id of every training op whose outcome became final. */
  outcomesChannel(): string {
    return `${this.prefix}:outcomes`;
  }
}

/** BullMQ job ids may not contain ':'; these are deterministic so a repeated submission is the same job. */
export const jobIds = {
  createModel: (modelId: string) => `c-${shortHash(modelId)}`,
  train: (modelId: string, seqId: number) => `t-${shortHash(modelId)}-${seqId}`,
  unload: (modelId: string) => `u-${shortHash(modelId)}`,
  loadOnCreate: (modelId: string) => `l-${shortHash(modelId)}`,
  sample: (samplingSessionId: string, seqId: number) => `s-${shortHash(samplingSessionId)}-${seqId}`,
};

/**
 * The ids the API hands out for what a session creates: its training models (`model_id`,
 * `<session_id>:train:<model_seq_id>`) and sampling sessions (`<session_id>:sample:<seq_id>`).
 * Deterministic, so a retried create names the same resource.
 */
export const resourceIds = {
  model: (sessionId: string, modelSeqId: number) => `${sessionId}:train:${modelSeqId}`,
  samplingSession: (sessionId: string, samplingSessionSeqId: number) => `${sessionId}:sample:${samplingSessionSeqId}`,
};
