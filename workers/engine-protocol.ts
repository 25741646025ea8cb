import { z } from 'zod';
import { MODEL_DTYPES } from '../queues/infra/config.js';
import { AdamParams, LoraConfig, SampleJob, SampleResult, Tensor, TargetPromptIds } from '../queues/contract/schemas.js';

/**
 * The agent ⇄ engine protocol (version 2, docs/engine-protocol.md): one zod schema per engine
 * operation, for its arguments and for its result. The TypeScript side types its calls with them
 * and parses every result with them (workers/engine.ts); the Python engines validate every request
 * against the same schemas, exported as JSON Schema to `workers/python/tinker_engine/protocol.json`
 * (`npm run engine-protocol`), and their tests validate every result. `test/engine-protocol.test.ts`
 * fails when the exported file and these schemas drift apart.
 */
export const PROTOCOL_VERSION = 2;

/**
 * A custom loss as the engine receives it: its shape only. The API checked it against the allowlist
 * (queues/contract/custom-loss.ts); the engine rebuilds it from the same allowlist, authoritatively.
 */
const EngineCustomLoss = z.object({
  name: z.string(),
  inputs: z.array(z.object({ name: z.string(), rank: z.number().int() })),
  graph: z.object({
    format: z.number().int(),
    nodes: z.array(z.object({ op: z.string(), name: z.string(), target: z.string(), args: z.array(z.unknown()), kwargs: z.record(z.string(), z.unknown()) })),
  }),
});

/** The integer dtypes a tensor can travel in; `int32` is a wire form of Tinker's int64 (token ids). */
export type WireDtype = 'float32' | 'int32' | 'int64';

/**
 * A tensor in a request: travels as raw little-endian bytes after the frame's JSON, never as a
 * JSON number list. Build it from a Tinker tensor with `BinTensor.from`.
 */
export class BinTensor {
  constructor(
    readonly dtype: WireDtype,
    readonly shape: readonly number[],
    readonly data: Float32Array | Int32Array | BigInt64Array,
  ) {}

  /** A Tinker tensor (`{dtype, shape, data}` with a JSON number list) as binary; ids that fit travel as int32. */
  static from(t: Tensor): BinTensor {
    return t.dtype === 'float32' ? new BinTensor('float32', t.shape, Float32Array.from(t.data)) : BinTensor.ints(t.shape, t.data);
  }

  /** Integers (token ids) of `shape`: int32 when every value fits, else int64. */
  static ints(shape: readonly number[], data: readonly number[]): BinTensor {
    let fits = true;
    for (const v of data) if (v < -0x80000000 || v > 0x7fffffff) { fits = false; break; }
    return fits ? new BinTensor('int32', shape, Int32Array.from(data)) : new BinTensor('int64', shape, BigInt64Array.from(data, BigInt));
  }
}

/** A request tensor (binary); its wire form is the JSON Schema keyword `{"tensor": true}`. */
const TensorArg = z.instanceof(BinTensor);

const ModelRef = z.object({ model_id: z.string().min(1) });
const DeviceMemory = z.object({
  device: z.string(),
  allocated_bytes: z.number().int(),
  reserved_bytes: z.number().int(),
  max_allocated_bytes: z.number().int(),
});

/** The per-request fields of `sample` and of each `sample_batch` request: the job's, with every score field required. */
export const SampleRequest = SampleJob.pick({
  adapter_dir: true,
  prompt: true,
  num_samples: true,
  sampling_params: true,
  prompt_logprobs: true,
  topk_prompt_logprobs: true,
}).extend({
  target_prompt_logprobs: TargetPromptIds.nullable(),
  topk_sample_logprobs: z.number().int().nonnegative(),
  prompt_alt_tokens_k: z.number().int().nonnegative(),
});
export type SampleRequest = z.infer<typeof SampleRequest>;

/** A sample result as the engine sends it: the Tinker result, with its score tables as tensors. */
export const EngineSampleResult = SampleResult.extend({
  target_prompt_logprobs: Tensor.nullish(),
  prompt_alt_tokens: z.object({ tokens: Tensor, logprobs: Tensor }).nullish(),
});

const EngineErrorBody = z.object({ category: z.enum(['user', 'server']), message: z.string() });

/** Which fields of a value broke its schema, for error messages. */
export function describeIssues(error: { issues: readonly { path: readonly PropertyKey[]; message: string }[] }): string {
  return error.issues.slice(0, 3).map((i) => `${i.path.map(String).join('.')}: ${i.message}`).join('; ');
}

const SampleBatchEntryStrict = z.discriminatedUnion('ok', [
  z.object({ ok: z.literal(true), result: EngineSampleResult }),
  z.object({ ok: z.literal(false), error: EngineErrorBody }),
]);
/** One request's answer in a sample_batch result; an invalid one (e.g. a NaN logprob) fails that request alone. */
const SampleBatchEntry = SampleBatchEntryStrict.catch((ctx) => ({
  ok: false as const,
  error: { category: 'server' as const, message: `the engine returned an invalid sample result (non-finite values?): ${describeIssues(ctx.error)}` },
}));

/** Every operation an engine answers: its arguments and its result. */
export const ENGINE_OPS = {
  hello: {
    args: z.object({}),
    result: z.object({
      protocol: z.number().int(),
      engine: z.string(),
      device: z.string(),
      torch: z.string(),
      /** verl engine only. */
      verl: z.string().optional(),
      world_size: z.number().int().optional(),
    }),
  },
  load_base: {
    args: z.object({ name: z.string().min(1), path: z.string().min(1), dtype: z.enum(MODEL_DTYPES).optional() }),
    result: z.object({
      name: z.string(),
      vocab_size: z.number().int(),
      arch: z.string(),
      max_context_length: z.number().int(),
      eos_token_id: z.number().int().nullable(),
    }),
  },
  create_model: {
    args: ModelRef.extend({ base_model: z.string().min(1), lora: LoraConfig }),
    result: z.object({ model_id: z.string(), lora_rank: z.number().int() }),
  },
  forward_backward: {
    args: ModelRef.extend({
      loss_fn: z.string().min(1),
      loss_fn_config: z.record(z.string(), z.union([z.number(), z.string()])),
      forward_only: z.boolean(),
      data: z.array(z.object({ tokens: TensorArg, loss_fn_inputs: z.record(z.string(), TensorArg) })).min(1),
      /** loss_fn `custom`: the custom loss's traced graph as data, rebuilt by the engine from the allowlist (tinker_engine/custom_loss.py). */
      custom_loss: EngineCustomLoss.optional(),
    }),
    result: z.object({
      loss_fn_outputs: z.array(z.record(z.string(), Tensor)),
      metrics: z.record(z.string(), z.number()),
    }),
  },
  /**
   * Several models' forward_backward on one base model in one pass (co-batching,
   * workers/python/tinker_engine/cobatch.py): one result per member, in order, or that member's error.
   */
  forward_backward_group: {
    args: z.object({
      members: z
        .array(
          z.object({
            model_id: z.string().min(1),
            loss_fn: z.string().min(1),
            loss_fn_config: z.record(z.string(), z.union([z.number(), z.string()])),
            forward_only: z.boolean(),
            data: z.array(z.object({ tokens: TensorArg, loss_fn_inputs: z.record(z.string(), TensorArg) })).min(1),
          }),
        )
        .min(1)
        .max(64),
    }),
    result: z.object({
      results: z.array(
        z.union([
          z.object({ loss_fn_outputs: z.array(z.record(z.string(), Tensor)), metrics: z.record(z.string(), z.number()) }),
          z.object({ error: z.object({ category: z.enum(['user', 'server']), message: z.string() }) }),
        ]),
      ),
    }),
  },
  optim_step: {
    args: ModelRef.extend({ adam: AdamParams }),
    result: z.object({ metrics: z.record(z.string(), z.number()) }),
  },
  save_sampler: {
    args: ModelRef.extend({ dir: z.string().min(1) }),
    result: z.object({ dir: z.string(), size_bytes: z.number().int() }),
  },
  save_state: {
    args: ModelRef.extend({ dir: z.string().min(1), optimizer: z.boolean(), gradients: z.boolean().optional() }),
    result: z.object({ dir: z.string(), size_bytes: z.number().int() }),
  },
  /** A continuous snapshot (workers/snapshots.ts): captured at once, written on the engine's writer thread under `root/<seq_id>`. */
  snapshot_state: {
    args: ModelRef.extend({ root: z.string().min(1), seq_id: z.number().int().nonnegative(), keep: z.number().int().positive(), wait: z.boolean().optional() }),
    result: z.object({ dir: z.string(), captured_bytes: z.number().int(), last_written: z.string().nullable(), last_error: z.string().nullable() }),
  },
  load_state: {
    args: ModelRef.extend({ dir: z.string().min(1), optimizer: z.boolean(), gradients: z.boolean().optional() }),
    result: z.object({ model_id: z.string(), has_optimizer: z.boolean() }),
  },
  unload_model: { args: ModelRef, result: ModelRef },
  sample: {
    args: SampleRequest.extend({ base_model: z.string().min(1) }),
    result: EngineSampleResult,
  },
  sample_batch: {
    args: z.object({ base_model: z.string().min(1), requests: z.array(SampleRequest).min(1) }),
    result: z.object({ results: z.array(SampleBatchEntry) }),
  },
  /** `release`: the device allocator's cached blocks are given back first (a GPU turn handed over, workers/gpu-turns.ts). */
  memory: { args: z.object({ reset_peak: z.boolean().optional(), release: z.boolean().optional() }), result: DeviceMemory },
} as const satisfies Record<string, { args: z.ZodType; result: z.ZodType }>;

export type EngineOp = keyof typeof ENGINE_OPS;
export type EngineArgs<O extends EngineOp> = z.input<(typeof ENGINE_OPS)[O]['args']>;
export type EngineResult<O extends EngineOp> = z.output<(typeof ENGINE_OPS)[O]['result']>;

/**
 * The protocol as JSON Schema (draft 2020-12) for the Python engines: `{protocol, ops: {op: {args,
 * result}}}`. A tensor, in either direction, is the keyword `{"tensor": true}`; objects are closed
 * (`additionalProperties: false`), so a field one side sends and the other does not know fails. A
 * field with a default (the sampling and Adam parameters, queues/contract/params.ts) is still
 * required, since the agent sends every field; its `default` is where the Python engines read it.
 */
export function protocolJsonSchema(): Record<string, unknown> {
  const toJson = (schema: z.ZodType): unknown => {
    const out = z.toJSONSchema(schema, {
      io: 'output',
      target: 'draft-2020-12',
      unrepresentable: 'any',
      override: (ctx) => {
        const js = ctx.jsonSchema as Record<string, unknown>;
        if (ctx.zodSchema === Tensor || ctx.zodSchema === TensorArg) {
          for (const k of Object.keys(js)) delete js[k];
          js.tensor = true;
        } else if (ctx.zodSchema === SampleBatchEntry) {
          // What the engine must send; the catch is the agent's way of failing one request alone.
          for (const k of Object.keys(js)) delete js[k];
          Object.assign(js, toJson(SampleBatchEntryStrict));
        }
      },
    }) as Record<string, unknown>;
    delete out.$schema;
    return out;
  };
  const ops: Record<string, unknown> = {};
  for (const [name, op] of Object.entries(ENGINE_OPS)) ops[name] = { args: toJson(op.args), result: toJson(op.result) };
  return {
    $comment: 'Generated from workers/engine-protocol.ts by `npm run engine-protocol`; do not edit.',
    protocol: PROTOCOL_VERSION,
    ops,
  };
}
