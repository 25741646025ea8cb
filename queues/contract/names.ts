import { createHash } from 'node:crypto';

/** A short hex digest, for names built from arbitrary strings. */
export function shortHash(s: string, n = 16): string {
  return createHash('sha1').update(s).digest('hex').slice(0, n);
}

/**
 * Every queue name and Redis key of a deployment, in one place, with its lifetime; `prefix` isolates
 * deployments (and tests) that share one Redis. "The retention" is `TB_FUTURE_RETENTION_S`
 * (the preset's `storage.retention_hours`, 24 h by default). Nothing grows with the history of a
 * deployment: a record lives while it is in use and one retention after that, and a listing's entry
 * leaves with the record it names (the API's listing sweep, `pruneListings` in
 * queues/registry/listings.ts, within a quarter of the retention, at most a minute). What stays without a TTL is bounded by what is in use
 * (agents, the models loaded on them) or by what the user chose to keep (named checkpoints, whose
 * files are on disk). `test/lifetimes.test.ts` checks this; `bench/redis-memory.ts` measures it.
 */
/** What a tenant's listings hold: its sessions, models (training runs), sampling sessions and checkpoints. */
export type TenantListing = 'sessions' | 'models' | 'samplers' | 'ckpts';

export class Names {
  constructor(readonly prefix: string) {}

  /**
   * BullMQ prefix for all queues of this deployment. Jobs (the futures) are kept for the retention
   * after they finish, and `TB_RESULT_TTL_AFTER_READ_S` after their result was first read (a
   * create_model job for the retention: its id makes a retried create idempotent); a queue's event
   * stream is capped by BullMQ (10 000 entries).
   */
  get bull(): string {
    return `${this.prefix}-bull`;
  }
  /** Training ops of the models placed on one agent, run one at a time. */
  trainQueue(agentId: string): string {
    return `train-${agentId}`;
  }
  /**
   * Sample jobs for one base model on one kind of engine, taken by every agent of that engine serving
   * it. The API picks the engine of each job (`sampleEngine` in queues/registry/agents.ts).
   */
  sampleQueue(baseModel: string, engine: string): string {
    return `sample-${shortHash(baseModel, 12)}-${engine}`;
  }

  /**
   * GPU turns (workers/gpu-turns.ts) of the agents sharing one GPU (`gpu`: `<node>/<index>`): the
   * holder's agent id, TTL the turn lease (a few seconds, renewed while held), so a dead holder's turn
   * ends by itself.
   */
  gpuTurnHolder(gpu: string): string {
    return `${this.prefix}:gpu-turn:${gpu}:holder`;
  }
  /** The agents waiting for that GPU (sorted set, score: when each first asked), TTL the lease, refreshed by each ask. */
  gpuTurnWants(gpu: string): string {
    return `${this.prefix}:gpu-turn:${gpu}:wants`;
  }
  /** The same agents, scored by when each last asked (an agent that stopped asking leaves both); TTL the lease, refreshed by each ask. */
  gpuTurnAsks(gpu: string): string {
    return `${this.prefix}:gpu-turn:${gpu}:asks`;
  }

  /**
   * How many jobs of one sample queue each live agent holds (a hash, agent id → `{active, concurrency, at}`,
   * workers/agent/sample-share.ts): each agent rewrites its field as its jobs start and end and every
   * half second, and removes it when it stops; a field older than 2 s is a dead agent's and is removed
   * by the next agent that reads it. TTL 10 s, restarted by every write: it leaves with the last agent.
   */
  sampleShare(queue: string): string {
    return `${this.prefix}:sample-share:${queue}`;
  }

  // Registries.
  /** Agent id → record (hash). No TTL: an entry leaves when the reaper reaps its agent (it stopped or died). */
  agents(): string {
    return `${this.prefix}:agents`;
  }
  /** `<incarnation> <ms>`, TTL the agent's timeout, refreshed every heartbeat (queues/runtime/liveness.ts). */
  agentAlive(agentId: string): string {
    const [before, after] = this.agentAliveParts();
    return `${before}${agentId}${after}`;
  }
  /** The text of an `agentAlive` key before and after the agent id (for queues/runtime/lua/agents-live.lua). */
  agentAliveParts(): [before: string, after: string] {
    return [`${this.prefix}:agent:`, ':alive'];
  }
  /** Why the reaper declared the agent dead (kept 7 days; the agent reads it at its next heartbeat). */
  agentReaped(agentId: string): string {
    return `${this.prefix}:agent:${agentId}:reaped`;
  }
  /** The models a drained agent saved for its next start (TTL TB_DRAIN_KEEP_S; while it exists, the agent is not reaped). */
  agentDrained(agentId: string): string {
    return `${this.prefix}:agent:${agentId}:drained`;
  }
  /**
   * Set (7 days, refreshed every heartbeat) by an agent that snapshots its models: when it dies,
   * its models wait for a live agent to adopt them (workers/agent/adoption.ts) instead of being lost,
   * and their ops are admitted meanwhile.
   */
  agentRecovers(agentId: string): string {
    return `${this.prefix}:agent:${agentId}:recovers`;
  }
  /** Set by `tinker-broker drain` (TTL the drain's timeout); the agent's next heartbeat takes it and drains. */
  agentDrainRequest(agentId: string): string {
    return `${this.prefix}:agent:${agentId}:drain-request`;
  }
  /**
   * A client session's record: TTL the retention, restarted by every heartbeat (the SDK sends one
   * every few seconds while its ServiceClient lives). Its `:models` and `:samplers` sets (what it
   * created) and `:finish` record (ServiceClient.close) share that lifetime.
   */
  session(sessionId: string): string {
    return `${this.prefix}:session:${sessionId}`;
  }
  /** The training models a session created (a set; the session's lifetime, `session`). */
  sessionModels(sessionId: string): string {
    return `${this.session(sessionId)}:models`;
  }
  /** The sampling sessions a session created (a set; the session's lifetime, `session`). */
  sessionSamplers(sessionId: string): string {
    return `${this.session(sessionId)}:samplers`;
  }
  /**
   * The custom losses a session created (create_custom_loss; a hash, field = custom_loss_seq_id,
   * queues/registry/custom-losses.ts): TTL the retention, restarted by every create and every
   * forward_backward that runs one.
   */
  sessionCustomLosses(sessionId: string): string {
    return `${this.session(sessionId)}:custom-losses`;
  }
  /** A session's first finish record, from ServiceClient.close (the session's lifetime, `session`). */
  sessionFinish(sessionId: string): string {
    return `${this.session(sessionId)}:finish`;
  }
  /**
   * A tenant's listing of its sessions, models (training runs), sampling sessions or checkpoints
   * (sorted sets by time). No TTL: session, model and sampling-session entries leave with their
   * record (the listing sweep), checkpoint entries with the checkpoint's record. The tenant quotas
   * (api/quotas.ts) count them.
   */
  tenantIndex(tenant: string, what: TenantListing): string {
    return `${this.prefix}:tenant:${tenant}:${what}`;
  }
  /** Every tenant that has a listing (a set; one member per API key ever used), for the listing sweep. */
  tenants(): string {
    return `${this.prefix}:tenants`;
  }
  /** The tenant that owns a future, by `request_id` (twice the retention; shortly once its result was read). */
  futureOwner(requestId: string): string {
    return `${this.prefix}:future-owner:${requestId}`;
  }
  /**
   * A training model (training run). TTL the retention, restarted by every training op submitted and,
   * while the model is loaded on a live agent, by that agent's every heartbeat to at least the agent's
   * timeout (so a model in use never expires, however long it is idle); a drain extends it by
   * TB_DRAIN_KEEP_S. No TTL while the run has a listed (named) checkpoint: a run is kept as long as a
   * checkpoint of it is. Its gate's `next` key has the same lifetime.
   */
  model(modelId: string): string {
    return `${this.prefix}:model:${modelId}`;
  }
  /** Models whose agent died, waiting for a live agent serving their base to adopt them: model id → ms orphaned (zset). */
  orphans(): string {
    return `${this.prefix}:models:orphans`;
  }
  /** An agent adopting the model holds this (its agent id, PX a few minutes) while it loads and moves it. */
  adoptClaim(modelId: string): string {
    return `${this.prefix}:model:${modelId}:adopt`;
  }
  /**
   * Where a training op's job went when its model was adopted by another agent: that agent's
   * queue, or `pending` until one adopts it (the future's request id still names the dead agent's
   * queue; api/futures.ts follows this). TTL the retention.
   */
  jobMoved(jobId: string): string {
    const [before, after] = this.jobMovedParts();
    return `${before}${jobId}${after}`;
  }
  /** The text of a `jobMoved` key before and after the job id (for queues/runtime/lua/train-relocate.lua). */
  jobMovedParts(): [before: string, after: string] {
    return [`${this.prefix}:job:`, ':moved'];
  }
  /** A sampling session: TTL the retention, restarted by every sample request that names it. */
  samplingSession(id: string): string {
    return `${this.prefix}:sampler:${id}`;
  }
  /** A training model's inflight sampler target (its newest `kind: inflight` save; TTL the retention from that save). */
  inflight(modelId: string): string {
    return `${this.prefix}:inflight:${modelId}`;
  }
  /** What stable_reinforce needs of one sampled sequence (queues/runtime/stability.ts; one day, restarted by each use). */
  stability(sequenceId: string): string {
    return `${this.prefix}:stability:${sequenceId}`;
  }
  /** A checkpoint's record: as long as the checkpoint (until deleted or its TTL; unnamed sampler saves: the retention). */
  checkpoint(tinkerPath: string): string {
    return `${this.prefix}:ckpt:${tinkerPath}`;
  }
  /** A model's checkpoints (sorted set by time); entries leave with the checkpoints' records. */
  modelCheckpoints(modelId: string): string {
    return `${this.prefix}:model-ckpts:${modelId}`;
  }
  /** Checkpoints with a TTL, by expiry (sorted set); entries leave with the checkpoints' records. */
  checkpointExpiry(): string {
    return `${this.prefix}:ckpt-expiry`;
  }
  /** One API process's claim on deleting an expired checkpoint (60 s). */
  checkpointSweepLock(tinkerPath: string): string {
    return `${this.prefix}:sweep:${tinkerPath}`;
  }
  /** copy_weights' `X-Idempotency-Key` → the copy's path (24 h). */
  copyIdempotency(tenant: string, key: string): string {
    return `${this.prefix}:idem:copy:${tenant}:${key}`;
  }
  /** The secret that signs download URLs (one key, no TTL). */
  urlSecret(): string {
    return `${this.prefix}:url-secret`;
  }
  /**
   * Operation metrics (queues/runtime/metrics.ts): fixed-size counters and histograms (no TTL), per-second
   * token counters (3 minutes), and engine stats per agent (the entry leaves when the agent stops or is reaped).
   */
  metrics(...parts: string[]): string {
    return [this.prefix, 'metrics', ...parts].join(':');
  }

  // The per-model ordering gate (see queues/runtime/gate.ts).
  /** The seq_id the gate releases next: the lifetime of the model's record (`model`). */
  gateNext(modelId: string): string {
    return `${this.prefix}:gate:${modelId}:next`;
  }
  /** Ops admitted ahead of a gap (exists only while one waits; a gap times out after TB_SEQ_GAP_TIMEOUT_S). */
  gateHeld(modelId: string): string {
    return `${this.prefix}:gate:${modelId}:held`;
  }
  /** Replay digests of a model's recent seq_ids (expire `window` seq_ids back, or with the key's TTL, the retention). */
  gateDigests(modelId: string): string {
    return `${this.prefix}:gate:${modelId}:digests`;
  }
  /** Job id -> model of every held op (entries leave when released or failed). */
  gateHeldIndex(): string {
    return `${this.prefix}:gate:held-index`;
  }
  /** Models with ops waiting behind a gap, scored by when the wait times out (entries leave at that deadline). */
  gateGaps(): string {
    return `${this.prefix}:gate:gaps`;
  }
  /** Each model's last training request (ISO time), shown in listings; a model's field leaves with its record (the listing sweep). */
  modelLast(): string {
    return `${this.prefix}:model-last`;
  }
  /** A future that failed before its job ran (kept for the retention). */
  failedFuture(jobId: string): string {
    return `${this.prefix}:failed-future:${jobId}`;
  }
  /** A training op's outcome record (queues/runtime/outcomes.ts; kept for the retention, shortly once read). */
  outcome(jobId: string): string {
    const [before, after] = this.outcomeParts();
    return `${before}${jobId}${after}`;
  }
  /** The text of an `outcome` key before and after the job id (for queues/runtime/lua/train-take.lua, which claims it). */
  outcomeParts(): [before: string, after: string] {
    return [`${this.prefix}:outcome:`, ''];
  }
  /**
   * Pub/sub channel: the job id of every training op whose outcome became final and of every sample
   * job that ended, with the final record when it is small (queues/runtime/completions.ts; holds nothing).
   */
  outcomesChannel(): string {
    return `${this.prefix}:outcomes`;
  }
  /**
   * The samples of one client of a sampling session that ended and that its `retrieve_futures` poller
   * has not acknowledged (a stream, queues/runtime/session-futures.ts). `clone` is the SDK's
   * cloned_sampler_id (its seq_ids start at 1e9·clone). At most SESSION_FUTURES_MAX entries; TTL
   * the retention, restarted by every entry and every poll, so it outlives its sampling session.
   */
  sessionFutures(samplingSessionId: string, clone: number): string {
    return `${this.samplingSession(samplingSessionId)}:futures:${clone}`;
  }
  /**
   * The request ids of one client's samples that were queued and whose entry is not in its
   * `sessionFutures` log yet (a set, queues/runtime/session-futures.ts): what a poll reconciles.
   * At most SESSION_PENDING_MAX members; TTL the retention, restarted by every sample queued.
   */
  sessionPending(samplingSessionId: string, clone: number): string {
    return `${this.samplingSession(samplingSessionId)}:pending:${clone}`;
  }
  /**
   * The request ids of one client's samples whose entry a reconcile wrote (a set): an entry their
   * agent writes after it is not reported again. At most SESSION_RECONCILED_MAX members; TTL the retention.
   */
  sessionReconciled(samplingSessionId: string, clone: number): string {
    return `${this.samplingSession(samplingSessionId)}:reconciled:${clone}`;
  }
  /** Held for SESSION_RECONCILE_EVERY_MS by the poll that reconciles one client's samples (one at a time, across API processes). */
  sessionReconcileTurn(samplingSessionId: string, clone: number): string {
    return `${this.samplingSession(samplingSessionId)}:reconcile:${clone}`;
  }
}

/** BullMQ job ids may not contain ':'; these are deterministic so a repeated submission is the same job. */
/** The job ids of a model's ops that run outside the seq_id order, in the order they run: its create, its load at create, its unload. */
export function modelSideJobIds(modelId: string): string[] {
  return [jobIds.createModel(modelId), jobIds.loadOnCreate(modelId), jobIds.unload(modelId)];
}

/** Whether a training queue's job is one of the model's ops. */
export function isModelJob(modelId: string, jobId: string): boolean {
  return jobId.startsWith(jobIds.train(modelId, 0).slice(0, -1)) || modelSideJobIds(modelId).includes(jobId);
}

export const jobIds = {
  createModel: (modelId: string) => `c-${shortHash(modelId)}`,
  train: (modelId: string, seqId: number) => `t-${shortHash(modelId)}-${seqId}`,
  unload: (modelId: string) => `u-${shortHash(modelId)}`,
  loadOnCreate: (modelId: string) => `l-${shortHash(modelId)}`,
  sample: (samplingSessionId: string, seqId: number) => `s-${shortHash(samplingSessionId)}-${seqId}`,
  /** create_custom_loss's future: answered at once, by an outcome record the API writes (no job). */
  customLoss: (sessionId: string, customLossSeqId: number) => `l-${shortHash(sessionId)}-loss-${customLossSeqId}`,
};

/**
 * The ids the API hands out for what a session creates: its training models (`model_id`,
 * `<session_id>:train:<model_seq_id>`) and sampling sessions (`<session_id>:sample:<seq_id>`).
 * Deterministic, so a retried create names the same resource.
 */
export const resourceIds = {
  model: (sessionId: string, modelSeqId: number) => `${sessionId}:train:${modelSeqId}`,
  samplingSession: (sessionId: string, samplingSessionSeqId: number) => `${sessionId}:sample:${samplingSessionSeqId}`,
  /** A custom loss (create_custom_loss): `<session_id>:loss:<custom_loss_seq_id>`. */
  customLoss: (sessionId: string, customLossSeqId: number) => `${sessionId}:loss:${customLossSeqId}`,
};
