import { z } from 'zod';
import { AdamParams, SamplingParams } from './params.js';
import { CustomLossSpec } from './custom-loss.js';

/**
 * The contract between the API and the agents: one schema per job type and per result,
 * the TypeScript types inferred from them. The API parses before it enqueues; the agent
 * parses `job.data` again because it crossed Redis.
 */

/** What a sample job carries when its sequences are to be recorded. */
export const RecordStability = z.object({
  session_id: z.string().nullable(),
  /** The request id the client got; sequence i is `<request_id>#<i>`. */
  request_id: z.string(),
});
export type RecordStability = z.infer<typeof RecordStability>;


/**
 * An array of finite numbers (`integers`: safe integers), checked in one loop: what
 * z.array(z.number()) and z.array(z.number().int()) accept, at a fifth of their cost per element (a
 * forward_backward's datums carry thousands of numbers, checked before admission and again in the
 * engine's result); the message names the first element that is not one.
 */
function numbers(integers: boolean) {
  const ok = integers ? Number.isSafeInteger : Number.isFinite;
  const kind = integers ? 'integers' : 'finite numbers';
  return z.custom<number[]>((v) => Array.isArray(v) && v.every((x) => ok(x)), {
    error: (iss) => {
      if (!Array.isArray(iss.input)) return `expected an array of ${kind}, got ${iss.input === null ? 'null' : typeof iss.input}`;
      const i = iss.input.findIndex((x) => !ok(x));
      const x: unknown = iss.input[i];
      return `expected an array of ${kind}; element ${i} is ${typeof x === 'number' || x === undefined ? String(x) : JSON.stringify(x)}`;
    },
  });
}

export const Tensor = z.object({
  dtype: z.enum(['float32', 'int64']),
  shape: z.array(z.number().int().nonnegative()),
  data: numbers(false),
});
export type Tensor = z.infer<typeof Tensor>;

export const Datum = z.object({
  /** The model input's tokens (text chunks concatenated). */
  tokens: numbers(true).refine((t) => t.length > 0, 'expected at least one token'),
  loss_fn_inputs: z.record(z.string(), Tensor),
});
export type Datum = z.infer<typeof Datum>;

export const LoraConfig = z.object({
  rank: z.number().int().positive(),
  seed: z.number().int().nullable(),
  train_unembed: z.boolean(),
  train_mlp: z.boolean(),
  train_attn: z.boolean(),
});
export type LoraConfig = z.infer<typeof LoraConfig>;

/** The sampling and Adam parameters are declared in params.ts, each field once; jobs carry them complete. */
export { AdamParams, SamplingParams } from './params.js';

// ---- Training queue jobs (one queue per agent, concurrency 1, seq_id order per model) ----

export const CreateModelJob = z.object({
  op: z.literal('create_model'),
  model_id: z.string(),
  base_model: z.string(),
  lora: LoraConfig,
});
/** What every ordered op carries: its model and its place in the client's seq_id order. */
const ordered = { model_id: z.string(), seq_id: z.number().int() };
/** A checkpoint op's `tinker://<model_id>/<kind>/<name>` and the directory of its files. */
const checkpoint = { ...ordered, tinker_path: z.string(), dir: z.string() };
/** How long a saved checkpoint lives (null: until deleted). */
const ttl = { ttl_seconds: z.number().int().positive().nullable() };
const userMetadata = { user_metadata: z.record(z.string(), z.string()).nullable() };

export const ForwardBackwardJob = z.object({
  op: z.literal('forward_backward'),
  ...ordered,
  loss_fn: z.string(),
  loss_fn_config: z.record(z.string(), z.union([z.number(), z.string()])),
  forward_only: z.boolean(),
  data: z.array(Datum).min(1),
  /** loss_fn `custom`: the stored custom loss that `loss_fn_config.loss_id` names (queues/contract/custom-loss.ts), for the engine to rebuild. */
  custom_loss: CustomLossSpec.optional(),
});
export const OptimStepJob = z.object({
  op: z.literal('optim_step'),
  ...ordered,
  adam: AdamParams,
});
/** save_weights_for_sampler: an immutable sampler version at `tinker://<model_id>/sampler_weights/<name>`. */
export const SaveSamplerJob = z.object({
  op: z.literal('save_weights_for_sampler'),
  ...checkpoint,
  /** Set for the unnamed save behind `save_weights_and_get_sampling_client`. */
  sampling_session_id: z.string().nullable(),
  /**
   * `inflight`: the save also becomes the model's inflight target, and the new sampling session
   * follows that target (it samples the newest inflight save of the model, never an older one).
   */
  kind: z.enum(['snapshot', 'inflight']).optional(),
  ...ttl,
  ...userMetadata,
});
/** save_weights: the training state (adapter and optimizer) as a named checkpoint. */
export const SaveStateJob = z.object({
  op: z.literal('save_weights'),
  ...checkpoint,
  /** Replace an existing checkpoint of that name. */
  overwrite: z.boolean(),
  ...ttl,
  ...userMetadata,
});
/** load_weights: a training checkpoint (of this or another compatible model) into this model. */
export const LoadStateJob = z.object({
  op: z.literal('load_weights'),
  ...checkpoint,
  optimizer: z.boolean(),
});
/** save_weights_external: the adapter as plain files (optionally age-encrypted) for download. */
export const SaveExternalJob = z.object({
  op: z.literal('save_weights_external'),
  ...checkpoint,
  ...ttl,
  /** age X25519 recipients (`age1…`); every file is then stored as `<name>.age`. */
  age_recipients: z.array(z.string()),
});
export const UnloadModelJob = z.object({
  op: z.literal('unload_model'),
  model_id: z.string(),
});
export const TrainJob = z.discriminatedUnion('op', [
  CreateModelJob,
  ForwardBackwardJob,
  OptimStepJob,
  SaveSamplerJob,
  SaveStateJob,
  LoadStateJob,
  SaveExternalJob,
  UnloadModelJob,
]);
export type TrainJob = z.infer<typeof TrainJob>;
export type CreateModelJob = z.infer<typeof CreateModelJob>;
export type ForwardBackwardJob = z.infer<typeof ForwardBackwardJob>;
export type OptimStepJob = z.infer<typeof OptimStepJob>;
export type SaveSamplerJob = z.infer<typeof SaveSamplerJob>;
export type SaveStateJob = z.infer<typeof SaveStateJob>;
export type LoadStateJob = z.infer<typeof LoadStateJob>;
export type UnloadModelJob = z.infer<typeof UnloadModelJob>;
export type SaveExternalJob = z.infer<typeof SaveExternalJob>;

// ---- Sample queue jobs (one queue per base model, concurrent) ----

/** The token ids a sample request scores at each prompt position (target_prompt_logprobs). */
export const TargetPromptIds = z.object({ k: z.number().int().positive(), ids: z.array(z.number().int()) });

export const SampleJob = z.object({
  op: z.literal('sample'),
  sampling_session_id: z.string(),
  seq_id: z.number().int(),
  base_model: z.string(),
  /** The sampler version's adapter directory; null samples the base model. */
  adapter_dir: z.string().nullable(),
  /** The sampler version's tinker path, for error messages. */
  model_path: z.string().nullable(),
  prompt: z.array(z.number().int()).min(1),
  num_samples: z.number().int().positive(),
  sampling_params: SamplingParams,
  prompt_logprobs: z.boolean(),
  topk_prompt_logprobs: z.number().int().nonnegative(),
  /** Top-K (id, logprob) of the distribution each generated token was drawn from; 0 = none. */
  topk_sample_logprobs: z.number().int().nonnegative().nullish(),
  /** k independent draws at every prompt position after the first (prompt_alt_tokens_k); 0 = none. */
  prompt_alt_tokens_k: z.number().int().nonnegative().nullish(),
  /** Token ids to score at each prompt position: dense row-major [len(prompt) - 1, k], -1 = none. */
  target_prompt_logprobs: TargetPromptIds.nullish(),
  /** Score only the last N prompt tokens: earlier prompt (and top-K) logprobs are null. */
  prompt_logprobs_last_n: z.number().int().positive().nullish(),
  /** Set when the client asked for record_stability_info: the agent records each sequence. */
  record_stability: RecordStability.nullish(),
});
export type SampleJob = z.infer<typeof SampleJob>;

export type AnyJob = TrainJob | SampleJob;
export type JobOp = AnyJob['op'];

// ---- Results (job return values) ----

export const CreateModelResult = z.object({ model_id: z.string() });
export const ForwardBackwardResult = z.object({
  loss_fn_outputs: z.array(z.record(z.string(), Tensor)),
  metrics: z.record(z.string(), z.number()),
});
export type ForwardBackwardResult = z.infer<typeof ForwardBackwardResult>;
export const OptimStepResult = z.object({ metrics: z.record(z.string(), z.number()) });
export const SaveSamplerResult = z.object({
  path: z.string(),
  sampling_session_id: z.string().nullable(),
});
export const SaveStateResult = z.object({ path: z.string() });
export const LoadStateResult = z.object({ path: z.string(), model_id: z.string() });
export const UnloadModelResult = z.object({ model_id: z.string() });
export const SaveExternalResult = z.object({ path: z.string(), size_bytes: z.number().int() });
export const SampleResult = z.object({
  sequences: z.array(
    z.object({
      tokens: z.array(z.number().int()),
      logprobs: z.array(z.number()),
      stop_reason: z.enum(['stop', 'length']),
      topk_logprobs: z.array(z.array(z.tuple([z.number().int(), z.number()]))).nullish(),
    }),
  ),
  prompt_logprobs: z.array(z.number().nullable()).nullable(),
  topk_prompt_logprobs: z.array(z.array(z.tuple([z.number().int(), z.number()])).nullable()).nullable(),
  /** The logprobs of the requested target_prompt_logprobs ids, same shape, 0.0 where none was requested. */
  target_prompt_logprobs: z.object({ shape: z.array(z.number().int()), data: z.array(z.number()) }).nullish(),
  /** The prompt_alt_tokens_k draws: token ids and their logprobs, both [len(prompt) - 1, k]. */
  prompt_alt_tokens: z
    .object({
      tokens: z.object({ shape: z.array(z.number().int()), data: z.array(z.number().int()) }),
      logprobs: z.object({ shape: z.array(z.number().int()), data: z.array(z.number()) }),
    })
    .nullish(),
});
export type SampleResult = z.infer<typeof SampleResult>;

export const ResultSchemas = {
  create_model: CreateModelResult,
  forward_backward: ForwardBackwardResult,
  optim_step: OptimStepResult,
  save_weights_for_sampler: SaveSamplerResult,
  save_weights: SaveStateResult,
  load_weights: LoadStateResult,
  unload_model: UnloadModelResult,
  save_weights_external: SaveExternalResult,
  sample: SampleResult,
  /** create_custom_loss's future: answered at once by the API (api/services/custom-loss.ts), no job. */
  create_custom_loss: z.object({ loss_id: z.string() }),
} as const satisfies Record<JobOp | 'create_custom_loss', z.ZodType>;
