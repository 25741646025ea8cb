import { randomUUID } from 'node:crypto';
import type { Request } from 'express';
import type { z } from 'zod';
import { BrokerError, failure, invalid } from '../../queues/contract/errors.js';
import { encodeRequestId } from '../../queues/contract/futures.js';
import type { SampleFeature } from '../../queues/infra/config.js';
import { jobIds, resourceIds } from '../../queues/contract/names.js';
import { sampleEngine } from '../../queues/registry/agents.js';
import { reportRefusedSample, trackPendingSample, untrackPendingSample } from '../../queues/runtime/session-futures.js';
import type { SamplingSessionRecord } from '../../queues/registry/samplers.js';
import type { SampleJob, SamplingParams } from '../../queues/contract/schemas.js';
import { tenantOf } from '../auth.js';
import type { ApiContext } from '../context.js';
import { ensureRoom } from '../quotas.js';
import type { CreateSamplingSessionBody, SampleBody, SamplingParamsBody } from '../http-schemas.js';
import { issueFuture, requireSamplingSession, requireSession } from '../tenants.js';
import { samplerWeights } from './checkpoints.js';


/** Sampling sessions (pinned to a base model or one immutable sampler version) and asample. */

type Target = Pick<SamplingSessionRecord, 'base_model' | 'model_path' | 'adapter_dir'>;

/** A session for a base model or a saved sampler version, resolved from the registries. */
async function resolveTarget(ctx: ApiContext, req: Request, baseModel: string | null | undefined, modelPath: string | null | undefined): Promise<Target> {
  if (modelPath) {
    const v = await samplerWeights(ctx, req, modelPath);
    return { base_model: v.base_model, model_path: modelPath, adapter_dir: v.dir };
  }
  const { model } = await ctx.registry.agents.resolveBaseModel(baseModel!);
  return { base_model: model.name, model_path: null, adapter_dir: null };
}

/** create_sampling_session: `<session_id>:sample:<seq>` on a base model or a sampler version. */
export async function createSamplingSession(ctx: ApiContext, req: Request, body: z.output<typeof CreateSamplingSessionBody>): Promise<string> {
  await requireSession(ctx, req, body.session_id);
  const target = await resolveTarget(ctx, req, body.base_model, body.model_path);
  const id = resourceIds.samplingSession(body.session_id, body.sampling_session_seq_id);
  await ensureRoom(ctx, req, 'samplers', async () => (await ctx.registry.samplers.get(id)) !== null);
  await ctx.registry.samplers.put({ sampling_session_id: id, session_id: body.session_id, ...target, tenant: tenantOf(req) }, ctx.config.retentionS);
  await ctx.registry.samplers.index(body.session_id, id, ctx.config.retentionS);
  return id;
}

function toEngineParams(p: z.output<typeof SamplingParamsBody>): SamplingParams {
  const stop = p.stop ?? null;
  const list = stop === null ? [] : typeof stop === 'string' ? [stop] : stop;
  return {
    max_tokens: p.max_tokens,
    temperature: p.temperature,
    top_k: p.top_k,
    top_p: p.top_p,
    seed: p.seed,
    stop_tokens: list.filter((s): s is number => typeof s === 'number'),
    stop_strings: list.filter((s): s is string => typeof s === 'string' && s.length > 0),
    // `stop: []` disables every stop, EOS included; `stop: null` keeps EOS.
    stop_at_eos: !(Array.isArray(stop) && stop.length === 0),
  };
}

/** Cells of target_prompt_logprobs one request may ask for (a float per cell comes back). */
const MAX_TARGET_CELLS = 1 << 20;

/**
 * `target_prompt_logprobs` (SDK TensorData JSON): int64 token ids, dense `[len(prompt) - 1, K]`,
 * `-1` where nothing is requested. Sparse CSR requests are refused (the answer would have to be
 * sparse too); send them dense.
 */
function parseTargetPromptLogprobs(raw: unknown, promptLen: number, vocabSize: number): { k: number; ids: number[] } | null {
  if (raw === undefined || raw === null) return null;
  const t = raw as { data?: unknown; dtype?: unknown; shape?: unknown; sparse_crow_indices?: unknown };
  if (t.sparse_crow_indices != null) throw invalid('target_prompt_logprobs: sparse CSR is not supported by this server; send it dense (-1 where nothing is requested)');
  if (!Array.isArray(t.data) || !t.data.every((v) => Number.isInteger(v))) throw invalid('target_prompt_logprobs.data must be a list of integer token ids');
  const shape = Array.isArray(t.shape) ? (t.shape as unknown[]) : [];
  const rows = promptLen - 1;
  if (shape.length !== 2 || shape[0] !== rows || !Number.isInteger(shape[1]) || (shape[1] as number) < 1)
    throw invalid(`target_prompt_logprobs must have shape [len(prompt) - 1, K] = [${rows}, K] with K >= 1, got [${shape.join(', ')}]`);
  const k = shape[1] as number;
  if (rows * k > MAX_TARGET_CELLS) throw invalid(`target_prompt_logprobs asks for ${rows * k} cells; at most ${MAX_TARGET_CELLS}`);
  const ids = t.data as number[];
  if (ids.length !== rows * k) throw invalid(`target_prompt_logprobs has ${ids.length} ids; shape [${rows}, ${k}] needs ${rows * k}`);
  for (const id of ids) if (id < -1 || id >= vocabSize) throw invalid(`target_prompt_logprobs: token id ${id} is outside the vocabulary [0, ${vocabSize}) (-1 requests nothing)`);
  return { k, ids };
}

type Body = z.output<typeof SampleBody>;

/** The session an asample names (or an ad-hoc one for base_model / model_path), at its current target. */
async function sampleTarget(ctx: ApiContext, req: Request, body: Body): Promise<{ target: Target; sessionId: string; ownerSession: string | null }> {
  if (body.sampling_session_id) {
    const s = await requireSamplingSession(ctx, req, body.sampling_session_id);
    // Inflight: the model's newest inflight save, which only moves forward from the one this session was created with.
    // (The session's lifetime is restarted where the request is admitted, in the same round trip.)
    const t = s.inflight_model_id ? await ctx.registry.samplers.inflightTarget(s.inflight_model_id) : null;
    const target = t ? { base_model: s.base_model, model_path: t.model_path, adapter_dir: t.adapter_dir } : s;
    // The client's session owns the stability records of this request's sequences.
    return { target, sessionId: s.sampling_session_id, ownerSession: s.session_id };
  }
  if (body.base_model || body.model_path)
    return { target: await resolveTarget(ctx, req, body.base_model, body.model_path), sessionId: `adhoc-${randomUUID()}`, ownerSession: null };
  throw invalid('asample needs sampling_session_id (or base_model / model_path)');
}

/**
 * asample: checks the request against the model's bounds, routes it to the sample queue of the
 * fastest engine serving its sampler version, and queues it; returns the future.
 */
export async function sample(ctx: ApiContext, req: Request, body: Body): Promise<{ request_id: string; sample_sequence_ids: string[] }> {
  const { target: session, sessionId, ownerSession } = await sampleTarget(ctx, req, body);
  const tokens: number[] = [];
  for (const c of body.prompt.chunks) {
    if (!('tokens' in c)) throw invalid(`prompt chunks of type '${c.type}' are not supported (text tokens only)`);
    for (const t of c.tokens as number[]) tokens.push(t);
  }
  if (tokens.length === 0) throw invalid('prompt is empty');
  // The served model and the sampler version (null: the base model; its LoRA rank decides which agents can serve it), read together;
  // the agents' read is shared with the sample requests that asked while it is in flight.
  const [{ model, agents }, version] = await Promise.all([
    ctx.registry.agents.resolveBaseModel(session.base_model, true),
    session.model_path ? ctx.registry.checkpoints.get(session.model_path) : null,
  ]);
  if (body.topk_prompt_logprobs > model.topk_max)
    throw invalid(`topk_prompt_logprobs ${body.topk_prompt_logprobs} exceeds the bound for this model (${model.topk_max})`);
  for (const t of tokens) if (t < 0 || t >= model.vocab_size) throw invalid(`prompt token id ${t} is outside the vocabulary [0, ${model.vocab_size})`);
  if (body.topk_sample_logprobs > model.topk_max)
    throw invalid(`topk_sample_logprobs ${body.topk_sample_logprobs} exceeds the bound for this model (${model.topk_max})`);
  if (body.prompt_alt_tokens_k > 0) {
    if (tokens.length < 2) throw invalid('prompt_alt_tokens_k needs a prompt of at least 2 tokens');
    if ((tokens.length - 1) * body.prompt_alt_tokens_k > MAX_TARGET_CELLS)
      throw invalid(`prompt_alt_tokens_k ${body.prompt_alt_tokens_k} asks for ${(tokens.length - 1) * body.prompt_alt_tokens_k} draws; at most ${MAX_TARGET_CELLS}`);
  }
  const targets = parseTargetPromptLogprobs(body.target_prompt_logprobs, tokens.length, model.vocab_size);
  const lastN = body.prompt_logprobs_last_n ?? null;
  if (lastN !== null) {
    if (!body.prompt_logprobs && body.topk_prompt_logprobs === 0) throw invalid('prompt_logprobs_last_n requires prompt_logprobs (or topk_prompt_logprobs)');
    if (lastN > tokens.length - 1) throw invalid(`prompt_logprobs_last_n ${lastN} must be between 1 and len(prompt) - 1 = ${tokens.length - 1}`);
  }
  const params = toEngineParams(body.sampling_params);
  for (const t of params.stop_tokens) if (t >= model.vocab_size) throw invalid(`stop token id ${t} is outside the vocabulary [0, ${model.vocab_size})`);
  if (tokens.length + params.max_tokens > model.max_context_length)
    throw invalid(`prompt (${tokens.length} tokens) + max_tokens (${params.max_tokens}) exceeds the model's context of ${model.max_context_length}`);

  const needs: SampleFeature[] = [];
  if (body.prompt_alt_tokens_k > 0) needs.push('prompt_alt_tokens_k');
  if (targets) needs.push('target_prompt_logprobs');
  if (version?.lora.train_unembed && (body.prompt_logprobs || body.topk_prompt_logprobs > 0)) needs.push('lm_head_prompt_logprobs');
  const queue = ctx.names.sampleQueue(session.base_model, sampleEngine(session.base_model, agents, version?.lora.rank ?? null, needs));
  // A seq_id JSON cannot carry exactly (past 2^53) cannot de-duplicate: such a request gets a fresh job.
  const seqId = body.seq_id != null && Number.isSafeInteger(body.seq_id) ? body.seq_id : null;
  const jobId = body.sampling_session_id && seqId !== null ? jobIds.sample(sessionId, seqId) : `s-${randomUUID()}`;
  const requestId = encodeRequestId({ queue, jobId });
  // The future is recorded only when it is handed out (not for a 429).
  const reply = async () => ({ request_id: await issueFuture(ctx, req, requestId), sample_sequence_ids: sequenceIds(requestId, body.num_samples) });
  // A session is pinned to one sampler version; never sample silently from other weights.
  if (session.model_path && !version) {
    const message = `sampling session ${sessionId} is pinned to sampler weights ${session.model_path}, which no longer exist (deleted or expired); save new sampler weights and create a new sampling client`;
    if (body.sampling_session_id) await ctx.registry.samplers.touch(sessionId, ctx.config.retentionS);
    await ctx.registry.futures.putFailed(jobId, { op: 'sample', category: 'user', code: 'STALE_SAMPLER', message }, ctx.config.retentionS);
    // Its client's retrieve_futures poller hears of it as of a sample that ran and failed.
    await reportRefusedSample(ctx.redis, ctx.names, { id: jobId, queue, sampling_session_id: sessionId, seq_id: seqId ?? -1 }, failure('STALE_SAMPLER', message), ctx.config.retentionS);
    return reply();
  }

  const job: SampleJob = {
    op: 'sample',
    sampling_session_id: sessionId,
    seq_id: seqId ?? -1,
    base_model: session.base_model,
    adapter_dir: session.adapter_dir,
    model_path: session.model_path,
    prompt: tokens,
    num_samples: body.num_samples,
    sampling_params: params,
    prompt_logprobs: body.prompt_logprobs ?? false,
    topk_prompt_logprobs: body.topk_prompt_logprobs,
    prompt_logprobs_last_n: lastN,
    target_prompt_logprobs: targets,
    topk_sample_logprobs: body.topk_sample_logprobs,
    prompt_alt_tokens_k: body.prompt_alt_tokens_k,
    // Only samples of a sampling session are recorded: the record belongs to that session (and its tenant).
    record_stability: body.record_stability_info && ownerSession ? { session_id: ownerSession, request_id: requestId } : null,
  };
  // Pending for its client's retrieve_futures poller before the job exists (sent first on the same
  // connection, in the same round trip): a sample that ends without its agent's entry is still
  // reported (queues/runtime/session-futures.ts).
  // Only while the SDK is told to use the poller (TB_SAMPLE_RETRIEVE_FUTURES): otherwise it fetches
  // every sample with retrieve_future, and nothing would read the record.
  const ref = { id: jobId, queue, sampling_session_id: sessionId, seq_id: seqId ?? -1 };
  const tracked = ctx.config.sampleRetrieveFutures ? trackPendingSample(ctx.redis, ctx.names, ref, ctx.config.retentionS) : Promise.resolve();
  // Its end is signalled to this process: its retrieve_future here waits for that without reading
  // its state first, and a fetch after the end answers from the record kept (api/futures.ts
  // expectSample). Before the submit, so an end that comes first is not missed.
  ctx.futures.expectSample({ queue, jobId }, tenantOf(req));
  // One round trip: the job queued (unless the queue is full), its owner recorded, the session's
  // lifetime restarted (a sampling client in use does not expire: a teacher's may sample for days).
  // A (sampling session, seq_id) names one request: a replay with another payload would silently
  // get the first one's samples, so it is refused; a true replay gets the same future.
  const submitted = ctx.queues.submitSample(queue, jobId, job, {
    maxWaiting: ctx.config.maxQueuedSamples,
    ownerKey: ctx.names.futureOwner(requestId),
    tenant: tenantOf(req),
    // Owner records outlive the job (kept for the retention after it finishes), as issueFuture's.
    ownerTtlS: ctx.config.retentionS * 2,
    session: body.sampling_session_id ? { key: ctx.names.samplingSession(sessionId), ttlS: ctx.config.retentionS } : null,
  });
  // Either failing fails the request: the client's retry is a replay, tracked again.
  const [admitted] = await Promise.all([submitted, tracked]).catch((e: unknown) => {
    ctx.futures.unexpectSample({ queue, jobId });
    throw e;
  });
  // No new job (a replay's may have ended already, and no end comes for a refused one).
  if (admitted !== 'queued') ctx.futures.unexpectSample({ queue, jobId });
  if (admitted === 'full') {
    if (ctx.config.sampleRetrieveFutures) await untrackPendingSample(ctx.redis, ctx.names, ref);
    throw new BrokerError('OVERLOADED', `sampling queue of ${session.base_model} is full; retry shortly`);
  }
  if (admitted === 'conflict')
    throw invalid(`seq_id ${seqId} of sampling session ${sessionId} was already used by a different sample request; a seq_id names one request`);
  return { request_id: requestId, sample_sequence_ids: sequenceIds(requestId, body.num_samples) };
}

function sequenceIds(requestId: string, n: number): string[] {
  return Array.from({ length: n }, (_, i) => `${requestId}#${i}`);
}
