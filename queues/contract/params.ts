import { z } from 'zod';

/**
 * The sampling parameters and the Adam parameters: each field, its bound and its default, declared
 * once. Everything else derives from these two schemas:
 * - the API's request bodies (api/http-schemas.ts) use them, with the SDK's optional forms;
 * - the jobs (schemas.ts) carry them with every default applied;
 * - the engine protocol (workers/engine-protocol.ts → protocol.json) exports them with their bounds
 *   and defaults, and the Python engines read both from there;
 * - the vLLM translation (workers/adapters/vllm/translate.ts) maps every field of SamplingParams.
 * test/one-source-params.test.ts compares each of these with this file.
 */

/** Tinker's AdamParams, for optim_step. A field the client leaves out takes its default. */
export const AdamParams = z.object({
  /** @defaultValue 1e-4 */
  learning_rate: z.number().finite().nonnegative().default(1e-4),
  /** @defaultValue 0.9 */
  beta1: z.number().min(0).lt(1).default(0.9),
  /** @defaultValue 0.95 */
  beta2: z.number().min(0).lt(1).default(0.95),
  /** @defaultValue 1e-12 */
  eps: z.number().finite().nonnegative().default(1e-12),
  /** Decoupled (AdamW) weight decay. @defaultValue 0 */
  weight_decay: z.number().finite().nonnegative().default(0),
  /** Clip the gradient's global norm to this before the step; 0 turns clipping off. @defaultValue 0 */
  grad_clip_norm: z.number().finite().nonnegative().default(0),
});
export type AdamParams = z.infer<typeof AdamParams>;

/**
 * What a sample job asks of token generation. The API builds it from the SDK's SamplingParams
 * (whose `stop` becomes `stop_tokens`, `stop_strings` and `stop_at_eos`).
 */
export const SamplingParams = z.object({
  /** Tokens generated at most per sequence. @defaultValue 256 */
  max_tokens: z.number().int().positive().default(256),
  /** 0 is greedy. @defaultValue 1 */
  temperature: z.number().finite().nonnegative().default(1),
  /** Keep the k most likely tokens; -1 or 0 turns it off. @defaultValue -1 */
  top_k: z.number().int().min(-1, 'top_k is -1 (off) or a positive count').default(-1),
  /** Nucleus sampling; 1 turns it off. @defaultValue 1 */
  top_p: z.number().gt(0).max(1).default(1),
  /** Seeds the request's draws; null draws at random. @defaultValue null */
  seed: z.number().int().nullable().default(null),
  /** Token ids that end a sequence (kept in its tokens). @defaultValue [] */
  stop_tokens: z.array(z.number().int().nonnegative()).default([]),
  /** Strings that end a sequence once its text contains one. @defaultValue [] */
  stop_strings: z.array(z.string().min(1)).default([]),
  /** False when the client sent `stop: []`, which disables every stop including EOS. @defaultValue true */
  stop_at_eos: z.boolean().default(true),
});
export type SamplingParams = z.infer<typeof SamplingParams>;
