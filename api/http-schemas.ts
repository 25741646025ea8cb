import { z } from 'zod';
import { invalid } from '../queues/contract/errors.js';
import { AdamParams, SamplingParams } from '../queues/contract/params.js';
import { CustomLossSpec } from '../queues/contract/custom-loss.js';

/**
 * Request bodies of the Tinker HTTP API (SDK 0.38), as the SDK sends them. Unknown fields
 * are ignored (newer SDKs add fields); missing or mistyped required fields are a 400.
 */
export function parseBody<S extends z.ZodType>(schema: S, body: unknown, what: string): z.output<S> {
  const res = schema.safeParse(body ?? {});
  if (!res.success) {
    const issues = res.error.issues.map((i) => `${i.path.length ? i.path.join('.') : '(body)'}: ${i.message}`);
    throw invalid(`invalid ${what} request: ${issues.join('; ')}`);
  }
  return res.data;
}

const id = z.string().min(1);
const nonNegInt = z.number().int().nonnegative();

/**
 * Bounds on the client-chosen fields kept in Redis (tags, user metadata, versions): Redis runs with
 * `noeviction`, so one request storing tens of MB under a tenant's session would stop the whole
 * deployment. Past a bound the request is a 400 naming the field and the bound.
 */
export const STORED_FIELD_LIMITS = { tags: 64, tagChars: 256, metadataEntries: 64, metadataKeyChars: 128, metadataBytes: 16_384, textChars: 256 } as const;
const L = STORED_FIELD_LIMITS;
const storedText = z.string().max(L.textChars, `at most ${L.textChars} characters`);
const tagList = z.array(z.string().max(L.tagChars, `a tag has at most ${L.tagChars} characters`)).max(L.tags, `at most ${L.tags} tags`);
/** A user_metadata object: at most 64 entries, keys of 128 characters, 16 KiB as JSON. */
const userMetadata = <V extends z.ZodType>(value: V) =>
  z.record(z.string(), value).superRefine((m, ctx) => {
    const keys = Object.keys(m);
    if (keys.length > L.metadataEntries) ctx.addIssue({ code: 'custom', message: `at most ${L.metadataEntries} entries` });
    else if (keys.some((k) => k.length > L.metadataKeyChars)) ctx.addIssue({ code: 'custom', message: `a user_metadata key has at most ${L.metadataKeyChars} characters` });
    else if (Buffer.byteLength(JSON.stringify(m)) > L.metadataBytes) ctx.addIssue({ code: 'custom', message: `at most ${L.metadataBytes} bytes as JSON` });
  });

/** `?limit=&offset=` of the REST listings (`defaultLimit` per listing). */
export const PageQuery = (defaultLimit = 20) =>
  z.object({
    limit: z.coerce.number().int().min(1).max(1000).default(defaultLimit),
    offset: z.coerce.number().int().min(0).default(0),
  });

export const CreateSessionBody = z.object({
  tags: tagList.default([]),
  user_metadata: userMetadata(z.unknown()).nullable().optional(),
  sdk_version: storedText.optional(),
  project_id: storedText.nullable().optional(),
});

export const SessionHeartbeatBody = z.object({ session_id: id });

export const CreateModelBody = z.object({
  session_id: id,
  model_seq_id: nonNegInt,
  base_model: id,
  user_metadata: userMetadata(z.unknown()).nullable().optional(),
  lora_config: z
    .object({
      rank: z.number().int().positive().max(1024),
      seed: z.number().int().nullable().optional(),
      train_unembed: z.boolean().default(true),
      train_mlp: z.boolean().default(true),
      train_attn: z.boolean().default(true),
    })
    .refine((l) => l.train_unembed || l.train_mlp || l.train_attn, 'at least one of train_unembed, train_mlp, train_attn must be true')
    .nullable()
    .optional(),
  optimizer_config: z.object({ type: z.string() }).passthrough().optional(),
});

export const ModelIdBody = z.object({ model_id: id });

export const OptimStepBody = z
  .object({
    model_id: id,
    seq_id: z.number().int().positive(),
    adam_params: AdamParams.optional(),
    optim_params: AdamParams.optional(),
    optimizer_params: z.object({ type: z.string() }).passthrough().optional(),
  })
  .superRefine((b, ctx) => {
    if (b.optimizer_params)
      ctx.addIssue({ code: 'custom', path: ['optimizer_params'], message: `optimizer '${b.optimizer_params.type}' is not supported by this server; supported: adamw (adam_params)` });
    else if (!b.adam_params && !b.optim_params) ctx.addIssue({ code: 'custom', path: ['adam_params'], message: 'required' });
  });

const checkpointName = z
  .string()
  .min(1)
  .max(200)
  .regex(/^[A-Za-z0-9][A-Za-z0-9_.-]*$/, 'checkpoint names use letters, digits, _ . - and start with a letter or digit');

export const SaveWeightsForSamplerBody = z
  .object({
    model_id: id,
    seq_id: z.number().int().positive(),
    path: checkpointName.nullable().optional(),
    sampling_session_seq_id: nonNegInt.nullable().optional(),
    kind: z.enum(['snapshot', 'inflight']).default('snapshot'),
    ttl_seconds: z.number().int().positive().nullable().optional(),
    user_metadata: userMetadata(z.string()).nullable().optional(),
  })
  .refine((b) => (b.path ?? null) !== null || (b.sampling_session_seq_id ?? null) !== null, {
    message: 'give either path (a named save) or sampling_session_seq_id',
  });

export const SaveWeightsBody = z.object({
  model_id: id,
  seq_id: z.number().int().positive(),
  path: checkpointName,
  ttl_seconds: z.number().int().positive().nullable().optional(),
  overwrite: z.boolean().default(false),
  user_metadata: userMetadata(z.string()).nullable().optional(),
});

export const SaveWeightsExternalBody = z.object({
  model_id: id,
  seq_id: z.number().int().positive(),
  path: checkpointName,
  ttl_seconds: z.number().int().positive().nullable().optional(),
  age_encryption_recipients: z.array(z.string()).nullable().optional(),
});

export const CopyWeightsBody = z.object({
  session_id: z.string().nullable().optional(),
  model_seq_id: nonNegInt.nullable().optional(),
  destination_project_id: z.string().nullable().optional(),
  source_path: z.string().startsWith('tinker://', 'source_path must be a tinker:// path'),
  ttl_seconds: z.number().int().positive().nullable().optional(),
});

export const LoadWeightsBody = z.object({
  model_id: id,
  seq_id: z.number().int().positive(),
  path: z.string().startsWith('tinker://', 'path must be a tinker:// path'),
  optimizer: z.boolean(),
  weights_access_token: z.string().nullable().optional(),
});

/** load_weights without model_id: create a model from a checkpoint (create_training_client_from_state). */
export const CreateViaLoadBody = z.object({
  session_id: id,
  model_seq_id: nonNegInt,
  base_model: z.string().nullable().optional(),
  path: z.string().startsWith('tinker://', 'path must be a tinker:// path'),
  optimizer: z.boolean(),
  optimizer_config: z.object({ type: z.string() }).passthrough().nullable().optional(),
  user_metadata: userMetadata(z.unknown()).nullable().optional(),
  weights_access_token: z.string().nullable().optional(),
});

export const JoinSamplingSessionBody = z.object({ sampling_session_id: id });

export const WeightsInfoBody = z.object({ tinker_path: z.string().startsWith('tinker://', 'tinker_path must be a tinker:// path') });

export const SessionSearchBody = z.object({
  session_id: z.string().nullable().optional(),
  user_metadata: z.record(z.string(), z.string()).default({}),
  display_name: z.string().nullable().optional(),
  statuses: z.array(z.object({ type: z.string() }).passthrough()).nullable().optional(),
  limit: z.number().int().min(1).max(200).default(50),
});

export const CheckpointTtlBody = z.object({ ttl_seconds: z.number().int().positive().nullable() });

export const FinishSessionBody = z.object({
  reason: z.object({ type: z.enum(['success', 'errored', 'interrupted']) }).passthrough(),
  detail: z.string().nullable().optional(),
});

export const CreateSamplingSessionBody = z
  .object({
    session_id: id,
    sampling_session_seq_id: nonNegInt,
    base_model: z.string().min(1).nullable().optional(),
    model_path: z.string().startsWith('tinker://').nullable().optional(),
  })
  .refine((b) => (b.base_model ?? null) !== null || (b.model_path ?? null) !== null, {
    message: 'give base_model or model_path',
  });

const EncodedTextChunk = z.object({ type: z.literal('encoded_text').default('encoded_text'), tokens: z.array(z.number().int()) });
const OtherChunk = z.object({ type: z.enum(['image', 'image_asset_pointer', 'dmel']) }).passthrough();
export const ModelInputBody = z.object({ chunks: z.array(z.union([EncodedTextChunk, OtherChunk])) });

/**
 * The SDK's SamplingParams: the job's fields (queues/contract/params.ts) with their bounds and
 * defaults, `max_tokens: null` meaning the default, and the SDK's `stop` (a string, a list of strings
 * or of token ids) in place of stop_tokens, stop_strings and stop_at_eos.
 */
const maxTokens = SamplingParams.shape.max_tokens;
export const SamplingParamsBody = z.object({
  max_tokens: maxTokens.unwrap().nullish().transform((v) => v ?? maxTokens.parse(undefined)),
  seed: SamplingParams.shape.seed,
  stop: z.union([z.string(), z.array(z.string()), z.array(z.number().int().nonnegative())]).nullable().optional(),
  ...SamplingParams.omit({ max_tokens: true, seed: true, stop_tokens: true, stop_strings: true, stop_at_eos: true }).shape,
});

export const SampleBody = z.object({
  num_samples: z.number().int().positive().max(1024).default(1),
  prompt: ModelInputBody,
  sampling_params: SamplingParamsBody,
  base_model: z.string().nullable().optional(),
  model_path: z.string().nullable().optional(),
  sampling_session_id: z.string().nullable().optional(),
  // Clones of a sampling client number from 1e9·k; beyond 2^53 a number is not exact in JSON here.
  seq_id: z.number().nonnegative().nullable().optional(),
  prompt_logprobs: z.boolean().nullable().optional(),
  topk_prompt_logprobs: z.number().int().nonnegative().max(100).default(0),
  topk_sample_logprobs: z.number().int().nonnegative().default(0),
  target_prompt_logprobs: z.unknown().optional(),
  prompt_alt_tokens_k: z.number().int().nonnegative().default(0),
  prompt_logprobs_last_n: z.number().int().positive().nullable().optional(),
  record_stability_info: z.boolean().nullable().optional(),
});

export const RetrieveFutureBody = z.object({
  request_id: id,
  allow_metadata_only: z.boolean().optional(),
});

/**
 * retrieve_futures (the SDK's session poller): one client of a sampling session (its
 * cloned_sampler_id), the cursor of its last answer (entries at or before it are acknowledged), and
 * how long to wait for an entry (seconds; absent: the long-poll window; 0: answer at once). The
 * results it has fetched (`retrieved_request_ids`) need nothing more here: a read already shortens
 * their lifetime (TB_RESULT_TTL_AFTER_READ_S).
 */
export const RetrieveFuturesBody = z.object({
  target: z.object({
    type: z.literal('sampling_session').default('sampling_session'),
    sampling_session_id: id,
    cloned_sampler_id: nonNegInt.default(0),
  }),
  prev_cursor: nonNegInt.default(0),
  timeout: z.number().nonnegative().nullable().optional(),
  retrieved_request_ids: z.array(z.string()).max(100_000).default([]),
});

/**
 * create_custom_loss (SDK `CreateCustomLossRequest`): the traced loss as plain data. Its graph's
 * structure, names and constants are checked against the allowlist by `checkCustomLoss`
 * (queues/contract/custom-loss.ts) before it is stored.
 */
export const CreateCustomLossBody = z.object({
  session_id: id,
  custom_loss_seq_id: nonNegInt.max(1_000_000_000),
  name: CustomLossSpec.shape.name,
  inputs: CustomLossSpec.shape.inputs,
  graph: CustomLossSpec.shape.graph,
});
