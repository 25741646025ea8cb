import { existsSync } from 'node:fs';
import os from 'node:os';
import path from 'node:path';
import { z } from 'zod';

/**
 * Process configuration, parsed once at start: the environment, over a preset's values when the
 * start command resolved one (presets/plan.ts hands them in as defaults the environment
 * overrides), through the schemas below into one typed object per process role. Invalid values
 * stop the process with a message naming the variable.
 */

/**
 * Sample-request fields some sampling engine cannot answer: the API sends a request using one to an
 * engine that can (queues/registry/agents.ts sampleEngine), and an engine that cannot refuses it clearly.
 * `lm_head_prompt_logprobs`: prompt logprobs of a sampler version with a LoRA on lm_head
 * (train_unembed), which vLLM on a GPU computes without that LoRA (docs/engines/vllm.md). What an
 * engine lacks is in its adapter's registration (workers/adapters/registry.ts), and each agent
 * publishes it in its record.
 */
export type SampleFeature = 'prompt_alt_tokens_k' | 'target_prompt_logprobs' | 'lm_head_prompt_logprobs';
/** Every SampleFeature, for the schema of the agents' records (AgentRecord.sample_lacks). */
export const SAMPLE_FEATURES = ['prompt_alt_tokens_k', 'target_prompt_logprobs', 'lm_head_prompt_logprobs'] as const satisfies readonly SampleFeature[];

/**
 * What parsing an agent's configuration needs to know of the engines: their kinds, the default, and
 * which train. The adapters' registry supplies it (workers/adapters/registry.ts engineCatalogue);
 * queues/ names no engine itself.
 */
export type EngineCatalogue = { kinds: readonly string[]; default: string; trains(kind: string): boolean };

/** GPUs named by a device string: `cuda` is GPU 0, `cuda:0,1` two GPUs, `cpu` (or anything else) none. */
export function deviceGpus(device: string | undefined): number[] {
  const m = /^cuda(?::(\d+(?:,\d+)*))?$/.exec(device ?? '');
  return m ? (m[1] ?? '0').split(',').map(Number) : [];
}
/** The weight dtypes a preset may ask of an engine (`models[].dtype`). */
export const MODEL_DTYPES = ['float32', 'bfloat16', 'float16'] as const;
export type ModelDtype = (typeof MODEL_DTYPES)[number];

const csv = z
  .string()
  .transform((s) => s.split(',').map((x) => x.trim()).filter(Boolean));

const bool = z.enum(['true', 'false']).transform((v) => v === 'true');

/** The engine process's log levels (Python's names). */
export const ENGINE_LOG_LEVELS = ['DEBUG', 'INFO', 'WARNING', 'ERROR'] as const;
/** The attention implementations the verl engine may build its models with (transformers' names). */
export const VERL_ATTENTIONS = ['sdpa', 'eager', 'flash_attention_2', 'flash_attention_3', 'flex_attention'] as const;

/** The torch engine's training layouts (`TB_ENGINE_LAYOUT`; tinker_engine/settings.py LAYOUTS). */
export const ENGINE_LAYOUTS = ['auto', 'packed', 'padded'] as const;
/** The torch engine's fused kernels (`TB_ENGINE_KERNELS`; tinker_engine/settings.py KERNELS). */
export const ENGINE_KERNELS = ['none', 'liger'] as const;
/** An engine flag's values (tinker_engine/settings.py `flag`): `true`/`1` or `false`/`0` (the agent passes `1`/`0`). */
const ENGINE_FLAG_VALUES = ['true', 'false', '1', '0'] as const;
const flagOn = (v: string): boolean => v === 'true' || v === '1';
/** An engine flag. */
const engineFlag = z.enum(ENGINE_FLAG_VALUES).transform(flagOn);
/** An engine flag, or `auto` (the engine chooses). */
const engineAutoFlag = z.enum(['auto', ...ENGINE_FLAG_VALUES]).transform((v): 'auto' | boolean => (v === 'auto' ? v : flagOn(v)));
/** An engine count: decimal digits only, at least 1 (the engines read no sign, space or exponent). */
const engineCount = z
  .string()
  .regex(/^[0-9]+$/, 'a positive integer')
  .transform(Number)
  .pipe(z.number().int().positive());

/**
 * The Python engines' settings a user may change, each declared here once with its bound and default.
 * The agent passes every one to its engine (`engineSettingsEnv`, from the adapters in
 * workers/adapters/), which reads them in one place per package (workers/python/tinker_engine/settings.py,
 * workers/python/tinker_engine_verl/settings.py, with these defaults for an engine started by hand;
 * test/one-source-engine-settings.test.ts compares the two sides). `TB_ENGINE_DEVICE`, which every
 * engine kind uses, is an agent setting below; the verl strategy and offload come from the preset's models, and
 * so do its padding and checkpointing levers where a model sets them.
 */
const EngineEnv = z.object({
  /** Torch engine: the base weights' dtype of a model whose preset entry names none (`float32`, `bfloat16`, `float16`). @defaultValue the engine's: `bfloat16` on a GPU, `float32` on the CPU */
  TB_ENGINE_DTYPE: z.enum(MODEL_DTYPES).optional(),
  /** The engine process's log level (`DEBUG`, `INFO`, `WARNING`, `ERROR`, any case); its line per op is at INFO. @defaultValue the agent's log level (TB_LOG_LEVEL) */
  TB_ENGINE_LOG_LEVEL: z
    .string()
    .transform((v) => v.toUpperCase())
    .pipe(z.enum(ENGINE_LOG_LEVELS))
    .optional(),
  /** Torch engine: cache slots one generating sample batch holds (rows × padded length at its longest); requests beyond wait for rows to finish. @defaultValue 262144 */
  TB_ENGINE_SAMPLE_TOKENS: engineCount.default(262_144),
  /** Torch engine: sampler versions (LoRA adapters) kept loaded per base model. @defaultValue 4 */
  TB_ENGINE_SAMPLER_CACHE: engineCount.default(4),
  /** Torch and verl engines: the most tokens of one training micro-batch (torch: real tokens when packed, padded ones when padded; verl's `max_token_len_per_gpu`). @defaultValue 16384 */
  TB_ENGINE_MAX_BATCH_TOKENS: engineCount.default(16_384),
  /** Torch engine: training micro-batches `packed` (one row, attention within each datum, no padding computed), `padded`, or `auto` (packed where the attention kernel is variable-length: flash-attn on CUDA). @defaultValue `auto` */
  TB_ENGINE_LAYOUT: z.enum(ENGINE_LAYOUTS).default('auto'),
  /** Torch engine: tokens per chunk of the output layer in training (the logits one chunk at a time, each recomputed in the backward; at or above TB_ENGINE_MAX_BATCH_TOKENS kept whole, the default). @defaultValue 16384 */
  TB_ENGINE_HEAD_CHUNK_TOKENS: engineCount.default(16_384),
  /** Torch engine: fused kernels in the base model's layers, `none` or `liger` (Liger's Triton RMSNorm, SwiGLU and rotary embedding; CUDA only, needs the liger-kernel package; a CPU engine refuses it at its start). @defaultValue `none` */
  TB_ENGINE_KERNELS: z.enum(ENGINE_KERNELS).default('none'),
  /** Torch engine on CUDA: let `scaled_dot_product_attention` use cuDNN's attention (`true`/`1`). Off by default: torch 2.11 tries cuDNN first on Hopper and newer GPUs, and cuDNN builds an execution plan for every new (batch, length) shape, tens of milliseconds each; a decode step's cache length is new at every step of a batch whose rows joined at another step, and a micro-batch's length with every datum mix (docs/benchmarks.md, "32 concurrent requests … on the 16-core GPU machine"). Off, torch picks flash, memory-efficient or math attention. @defaultValue false */
  TB_ENGINE_CUDNN_ATTENTION: engineFlag.default(false),
  /** verl engine: gradient checkpointing (`true`/`1`, `false`/`0`), or `auto`: chosen from the model's size and the GPU's memory, printed as the model is built (workers/python/tinker_engine_verl/levers.py); on for CPU ranks. A model's preset `gradient_checkpointing` wins. @defaultValue `auto` */
  TB_VERL_GRAD_CKPT: engineAutoFlag.default('auto'),
  /** verl engine: padding removed (verl's `use_remove_padding`: a micro-batch's rows packed into one, no padding computed), `true`/`1`, `false`/`0`, or `auto`: on where a variable-length attention kernel runs (CUDA with flash-attn's attention, or torch's `varlen_attn` in place of `sdpa`). A model's preset `remove_padding` wins. @defaultValue `auto` */
  TB_VERL_REMOVE_PADDING: engineAutoFlag.default('auto'),
  /** verl engine: the models' attention implementation (`sdpa`, `eager`, `flash_attention_2`, `flash_attention_3`, `flex_attention`; the flash ones need the flash-attn package). @defaultValue `sdpa` */
  TB_VERL_ATTN: z.enum(VERL_ATTENTIONS).default('sdpa'),
});

/** The engines' settings, by the variable each engine reads. */
export type EngineSettings = z.output<typeof EngineEnv>;
/** The variables of the engines' settings. */
export const ENGINE_SETTING_NAMES: readonly string[] = Object.keys(EngineEnv.shape);

/**
 * Engine variables that are no setting of the agent: knobs of the tests and benches, which the engine
 * reads from its own environment (the agent's, passed through). `TB_ENGINE_CHECK_RESULTS`: every result
 * checked against its op's schema; `TB_LOSS_CATALOGUE`: another copy of queues/contract/losses.json;
 * `TB_VERL_RECORD`, `TB_VERL_RECORD_MAX_TOKENS`: the verl engine writes translation fixtures. Every other
 * `TB_ENGINE_*` or `TB_VERL_*` variable of the agent's environment stays out of the engine's
 * (workers/engine.ts): the engine gets what the agent's configuration decided.
 */
export const ENGINE_INTERNAL_ENV: readonly string[] = ['TB_ENGINE_CHECK_RESULTS', 'TB_LOSS_CATALOGUE', 'TB_VERL_RECORD', 'TB_VERL_RECORD_MAX_TOKENS'];

/** The engine process's variables for `settings` (each one that has a value; flags as `1`/`0`). Without settings: every default. */
export function engineSettingsEnv(settings: EngineSettings = EngineEnv.parse({})): Record<string, string> {
  const env: Record<string, string> = {};
  for (const [name, value] of Object.entries(settings)) if (value !== undefined) env[name] = typeof value === 'boolean' ? (value ? '1' : '0') : String(value);
  return env;
}

const CommonEnv = z.object({
  /** Redis connection URL. @defaultValue `redis://127.0.0.1:6379` */
  REDIS_URL: z.string().url().default('redis://127.0.0.1:6379'),
  /** Prefix of every Redis key and BullMQ queue of this deployment. @defaultValue `tb` */
  TB_PREFIX: z.string().regex(/^[a-zA-Z0-9_-]+$/).default('tb'),
  /** Directory for sampler weights and checkpoints, shared by the API and agents. @defaultValue `var/storage` */
  TB_STORAGE_DIR: z.string().default('var/storage'),
  /** How long finished futures stay retrievable, in seconds. @defaultValue 86400 (24 h) */
  TB_FUTURE_RETENTION_S: z.coerce.number().int().positive().default(86_400),
});

/** The torch engine's sample-gathering defaults (TB_SAMPLE_GATHER_MS, TB_SAMPLE_HOLD_MS, TB_SAMPLE_BATCH_TOKENS), for configs built without them too. */
export const SAMPLE_GATHER_DEFAULTS = { gatherMs: 10, holdMs: 10, batchTokens: 131072 } as const;

const ApiEnv = CommonEnv.extend({
  /** Interface the API listens on. @defaultValue `127.0.0.1` */
  TB_HOST: z.string().default('127.0.0.1'),
  /** Port the API listens on; 0 picks a free one. @defaultValue 8000 */
  TB_PORT: z.coerce.number().int().min(0).max(65535).default(8000),
  /** Accepted `X-API-Key` values, comma separated (SDK keys must start with `tml-`). @defaultValue `tml-local` */
  TB_API_KEYS: csv.default(['tml-local']),
  /** Longest time a `retrieve_future` call is held open before `try_again`, in ms. @defaultValue 25000 */
  TB_LONG_POLL_MS: z.coerce.number().int().positive().default(25_000),
  /**
   * Tell the SDK to wait for samples through its session poller (`sample_use_retrieve_futures`,
   * /api/v1/retrieve_futures) instead of one retrieve_future long-poll per sample. @defaultValue false
   */
  TB_SAMPLE_RETRIEVE_FUTURES: bool.default(false),
  /** Base models that must be served before `/healthz` reports `ready`; empty: any agent. */
  TB_REQUIRED_MODELS: csv.default([]),
  /** Keys that open the /admin queue dashboard (it shows every tenant's jobs). @defaultValue the API key when exactly one is configured, else none */
  TB_ADMIN_KEYS: csv.optional(),
  /** Most waiting sample jobs per base model before `asample` answers 429. @defaultValue 2000 */
  TB_MAX_QUEUED_SAMPLES: z.coerce.number().int().positive().default(2000),
  /** Training seq_ids accepted ahead of a model's next op (more are refused); replays are recognised this far back. @defaultValue 1024 */
  TB_SEQ_WINDOW: z.coerce.number().int().min(16).default(1024),
  /** Seconds ops wait behind a missing seq_id before they fail. @defaultValue 120 */
  TB_SEQ_GAP_TIMEOUT_S: z.coerce.number().positive().default(120),
  /** Seconds a training or sample result stays in Redis once it has been read. @defaultValue 300 */
  TB_RESULT_TTL_AFTER_READ_S: z.coerce.number().int().positive().default(300),
  /** Largest forward_backward body, in MiB (the SDK sends chunks of about 5 MB; one datum of a 128k context with (N, 20) targets is about 31 MB). @defaultValue 64 */
  TB_MAX_TRAIN_BODY_MB: z.coerce.number().int().positive().default(64),
  /** Most sessions one API key holds (finished ones count until they expire). @defaultValue 2000 */
  TB_TENANT_MAX_SESSIONS: z.coerce.number().int().positive().default(2_000),
  /** Most training models (training runs) one API key holds, lost ones included until they expire. @defaultValue 1000 */
  TB_TENANT_MAX_MODELS: z.coerce.number().int().positive().default(1_000),
  /** Most sampling sessions one API key holds (an RL loop makes one per sampler version). @defaultValue 100000 */
  TB_TENANT_MAX_SAMPLING_SESSIONS: z.coerce.number().int().positive().default(100_000),
  /** Most checkpoints (training state, sampler weights, external weights) one API key holds. @defaultValue 100000 */
  TB_TENANT_MAX_CHECKPOINTS: z.coerce.number().int().positive().default(100_000),
});

/** Bounds of co-batching's settings: TB_COBATCH_MAX and TB_COBATCH_WAIT_MS, and a preset agent's `cobatch`. */
export const COBATCH_LIMITS = { max: 64, waitMs: 1000 } as const;

const AgentEnv = CommonEnv.extend({
  /** This agent's id in the registry and in its queue name. @defaultValue `<hostname>-<pid>` */
  TB_AGENT_ID: z.string().regex(/^[a-zA-Z0-9_.-]+$/).optional(),
  /** Base models this agent serves: `path[=alias]`, comma separated (required without a preset). */
  TB_AGENT_MODELS: csv.pipe(z.array(z.string()).min(1, 'name at least one base model directory')).optional(),
  /** Python interpreter of the engine. @defaultValue `.venv/bin/python` when it exists, else `python3` */
  TB_PYTHON: z.string().optional(),
  /** Device for the engine (`cpu`, `cuda`, `cuda:1`); empty lets the engine choose. */
  TB_ENGINE_DEVICE: z.string().optional(),
  /** Sample jobs one agent holds at once (per base model); the torch engine generates them as batches. @defaultValue 64 */
  TB_SAMPLE_CONCURRENCY: z.coerce.number().int().positive().default(64),
  /** Torch engine: a sample batch stays open this long after its last arrival while jobs wait (0: no gathering). @defaultValue 10 */
  TB_SAMPLE_GATHER_MS: z.coerce.number().int().nonnegative().default(SAMPLE_GATHER_DEFAULTS.gatherMs),
  /**
   * Torch engine: how long the first sample job to reach an idle engine waits for company (the other
   * requests of a burst, which a client sends one after another) before its batch goes; the batch then
   * closes as any other (TB_SAMPLE_GATHER_MS after the last arrival, at most five times that after the
   * first; the hold too is capped there). 0, or TB_SAMPLE_GATHER_MS=0: a lone job on an idle engine
   * goes at once. Figures: docs/benchmarks.md, "Holding the first job of a burst". @defaultValue 10
   */
  TB_SAMPLE_HOLD_MS: z.coerce.number().int().nonnegative().default(SAMPLE_GATHER_DEFAULTS.holdMs),
  /** Torch engine: a sample batch holds at most this many tokens (num_samples × (prompt + max_tokens), summed). @defaultValue 131072 */
  TB_SAMPLE_BATCH_TOKENS: z.coerce.number().int().positive().default(SAMPLE_GATHER_DEFAULTS.batchTokens),
  /** Restart the engine process when it dies. @defaultValue true */
  TB_ENGINE_RESTART: bool.default(true),
  /**
   * Torch engine on the CPU (device `cpu`): torch's threads in the engine process (its
   * `OMP_NUM_THREADS`). The engine shares the machine's cores with the agent, the API and Redis,
   * and threads on every core keep them all busy (they spin between ops). Figures:
   * docs/benchmarks-history.md, "2026-12-02 (later): one engine thread on the CPU".
   * @defaultValue on device `cpu` without `OMP_NUM_THREADS` set: one fewer than the machine's cores, at least 1; else torch's own
   */
  TB_ENGINE_THREADS: z.coerce.number().int().positive().optional(),
  /** Engine of the models served (a kind registered in workers/adapters/registry.ts). @defaultValue the registered default (torch) */
  TB_ENGINE: z.string().regex(/^[a-zA-Z0-9_-]+$/, 'an engine kind: letters, digits, _ and -').optional(),
  /** vLLM engine: attach to running OpenAI-compatible servers (one URL per model, comma separated) instead of starting `vllm serve`. */
  TB_VLLM_URL: csv.optional(),
  /** vLLM engine: the `vllm` executable. @defaultValue `.venv-vllm/bin/vllm` when it exists, else `vllm` */
  TB_VLLM_BIN: z.string().optional(),
  /** vLLM engine: sampler versions kept loaded per base model. @defaultValue 8 */
  TB_VLLM_MAX_ADAPTERS: z.coerce.number().int().positive().default(8),
  /** vLLM engine: seconds a server may take to become healthy. @defaultValue 1200 */
  TB_VLLM_START_TIMEOUT_S: z.coerce.number().positive().default(1200),
  /**
   * The share of its GPU this agent's engine may use, 0 < x ≤ 1 (a preset's `gpu_memory`): the torch
   * engine caps its allocator there (`torch.cuda.set_per_process_memory_fraction`), vLLM takes it as
   * `--gpu-memory-utilization`. @defaultValue the engine's own (torch: all of it; vLLM: 0.9)
   */
  TB_GPU_MEMORY: z.coerce.number().gt(0).max(1).optional(),
  /**
   * GPU turns (workers/gpu-turns.ts): the shared GPU, `<node>/<index>`, whose turn this agent takes
   * with the other agents on it (a preset's `take_turns`); unset: no turns.
   */
  TB_GPU_TURNS: z.string().regex(/^\S+\/(cpu|\d+)$/, 'a GPU as <node>/<index> (or <node>/cpu)').optional(),
  /** GPU turns: the longest turn while another agent waits, in ms. @defaultValue 30000 */
  TB_GPU_TURN_MAX_MS: z.coerce.number().int().positive().default(30_000),
  /** vLLM engine taking GPU turns: the sleep level of its hand-over (1: weights to CPU memory, KV cache dropped; 2: both dropped, the weights read again from the model directory after wake-up, vLLM's reload_weights). A preset agent's `sleep_level`. @defaultValue 1 */
  TB_VLLM_SLEEP_LEVEL: z.coerce.number().int().min(1).max(2).default(1),
  /** vLLM engine: appended to the `vllm serve` command line, space separated (e.g. `--max-model-len 8192`). */
  TB_VLLM_EXTRA_ARGS: z.string().default('').transform((s) => s.split(/\s+/).filter(Boolean)),
  // Reliability (docs/reliability.md).
  /** Seconds without a heartbeat after which the agent counts as dead: its futures fail (OUTCOME_UNKNOWN), its models are unavailable. @defaultValue 30 */
  TB_AGENT_TIMEOUT_S: z.coerce.number().positive().default(30),
  /** Per-op engine time limits, `op=seconds`, comma separated (ops: see docs/reliability.md); an op past its limit kills the engine. */
  TB_OP_TIMEOUTS: csv.default([]),
  /** BullMQ's job lock, in ms (a Redis outage longer than this loses the lock; outcomes are recorded apart from it). @defaultValue 30000 */
  TB_JOB_LOCK_MS: z.coerce.number().int().positive().default(30_000),
  /** How long a drained agent's saved models wait for its restart, in seconds; meanwhile its futures stay pending. @defaultValue 3600 */
  TB_DRAIN_KEEP_S: z.coerce.number().int().positive().default(3_600),
  /** Snapshot each model every this many optim_steps (0: by time only; both 0: no snapshots). @defaultValue 1 */
  TB_SNAPSHOT_EVERY_STEPS: z.coerce.number().int().min(0).default(1),
  /** Snapshot each model when this many seconds passed since its last snapshot, at its next optim_step (0: by steps only). @defaultValue 0 */
  TB_SNAPSHOT_EVERY_S: z.coerce.number().min(0).default(0),
  /** Snapshots kept per model (the newest). @defaultValue 2 */
  TB_SNAPSHOT_KEEP: z.coerce.number().int().positive().default(2),
  /**
   * Co-batching (docs/architecture.md): at most this many forward_backward ops of different models on
   * one base model run in one engine pass, taken from those already queued (1: one at a time; an
   * engine without co-batching: one at a time). @defaultValue 4
   */
  TB_COBATCH_MAX: z.coerce.number().int().min(1).max(COBATCH_LIMITS.max).default(4),
  /**
   * Co-batching's gather window (docs/architecture.md): a forward_backward whose turn comes waits at
   * most this many milliseconds for the models that trained here lately to queue theirs, then runs
   * with whatever partners are waiting (0: only what is already queued). @defaultValue 0
   */
  TB_COBATCH_WAIT_MS: z.coerce.number().int().min(0).max(COBATCH_LIMITS.waitMs).default(0),
  ...EngineEnv.shape,
});

/** Every variable of an agent's configuration (the engine settings among them). */
export const AGENT_ENV_NAMES: readonly string[] = Object.keys(AgentEnv.shape);

/** What `tinker-broker start` itself reads. */
const LauncherEnv = z.object({
  /** When set, how long a stop waits for the agents' drain before exiting, in seconds. */
  TB_STOP_GRACE_S: z.coerce.number().positive().optional(),
  /** Data directory of a Redis that `start` starts itself. @defaultValue `var/redis` */
  TB_REDIS_DIR: z.string().default('var/redis'),
});

/** Variables a preset's values come in as (presets/plan.ts); the environment overrides each. */
export type EnvDefaults = Partial<Record<keyof z.input<typeof ApiEnv> | keyof z.input<typeof AgentEnv>, string>>;

export type CommonConfig = { redisUrl: string; prefix: string; storageDir: string; retentionS: number };

export type ApiConfig = {
  redisUrl: string;
  prefix: string;
  storageDir: string;
  retentionS: number;
  host: string;
  port: number;
  apiKeys: string[];
  longPollMs: number;
  /** The SDK waits for samples through retrieve_futures (TB_SAMPLE_RETRIEVE_FUTURES). @defaultValue false */
  sampleRetrieveFutures?: boolean;
  requiredModels: string[];
  maxQueuedSamples: number;
  /** @defaultValue 1024 (TB_SEQ_WINDOW) */
  seqWindow?: number | undefined;
  /** @defaultValue 120 000 (TB_SEQ_GAP_TIMEOUT_S) */
  seqGapTimeoutMs?: number | undefined;
  /** @defaultValue 300 (TB_RESULT_TTL_AFTER_READ_S) */
  resultTtlAfterReadS?: number | undefined;
  /** @defaultValue 64 (TB_MAX_TRAIN_BODY_MB) */
  maxTrainBodyMb?: number | undefined;
  /** Keys of the /admin dashboard; unset: the API key when there is exactly one. */
  adminKeys?: string[] | undefined;
  /** What one API key may hold at once (TB_TENANT_MAX_*); unset: the defaults (api/quotas.ts). */
  tenantMax?: Partial<TenantMax> | undefined;
};

/** The tenant quotas: the most records of each kind one API key holds. */
export type TenantMax = { sessions: number; models: number; samplers: number; ckpts: number };

export type BaseModelSpec = {
  /** Canonical name: the absolute path of the model directory. */
  name: string;
  path: string;
  /** What `get_info` names as the tokenizer (the preset's `tokenizer`: a hub id or a directory). @defaultValue `path` */
  tokenizer?: string | undefined;
  /** Other names clients may use as `base_model`. */
  aliases: string[];
  /** Whether LoRA models may be trained on it (role `actor`); teachers and references are frozen. */
  trainable: boolean;
  /** Largest LoRA rank accepted. */
  loraMaxRank: number;
  /** Largest K of top-K prompt logprobs. */
  topkMax: number;
  /** Weight dtype, when the preset sets one. */
  dtype?: ModelDtype | undefined;
  /** GPUs the engine splits the model over (the preset's `parallelism.tensor`; vLLM `--tensor-parallel-size`). @defaultValue 1 */
  tensorParallel?: number | undefined;
  /** vLLM engine: expert parallelism over the tensor-parallel GPUs (the preset's `parallelism.expert` > 1; `--enable-expert-parallel`). */
  expertParallel?: boolean | undefined;
  /** verl engine: the preset's `parallelism.data`, the ranks FSDP shards the model over (on a `cpu` agent, the CPU ranks torchrun starts). */
  dataParallel?: number | undefined;
  /** verl engine: the preset's `parallelism.strategy` (fsdp2 when unset). */
  strategy?: string | undefined;
  /** verl engine: the preset's `offload` (parameters and optimizer state in CPU memory between steps). */
  offload?: boolean | undefined;
  /** verl engine: the preset's `remove_padding`, when set (else the agent's TB_VERL_REMOVE_PADDING). */
  removePadding?: boolean | undefined;
  /** verl engine: the preset's `gradient_checkpointing`, when set (else the agent's TB_VERL_GRAD_CKPT). */
  gradientCheckpointing?: boolean | undefined;
  /** vLLM engine: the preset's `load_format`; `dummy`: random weights from the config alone (benchmarks only). */
  loadFormat?: 'dummy' | undefined;
};

export const MODEL_DEFAULTS = { trainable: true, loraMaxRank: 64, topkMax: 20 } as const;

export type AgentConfig = {
  redisUrl: string;
  prefix: string;
  storageDir: string;
  retentionS: number;
  agentId: string;
  models: BaseModelSpec[];
  python: string;
  engineDevice: string | undefined;
  sampleConcurrency: number;
  /** Sample gathering window in ms (torch engine). @defaultValue 10 */
  sampleGatherMs?: number | undefined;
  /** How long a lone sample job on an idle engine waits for company (torch engine; TB_SAMPLE_HOLD_MS). @defaultValue 10 */
  sampleHoldMs?: number | undefined;
  /** Token budget of one sample batch (torch engine). @defaultValue 131072 */
  sampleBatchTokens?: number | undefined;
  engineRestart: boolean;
  /** Torch engine: its CPU threads (`OMP_NUM_THREADS` of the engine process); undefined: torch's own (TB_ENGINE_THREADS). */
  engineThreads?: number | undefined;
  /** The engine kind (workers/adapters/registry.ts). @defaultValue the registered default (torch) */
  engine?: string | undefined;
  /** vLLM engine: URLs of running servers to attach to, one per model in `models` order (none: the agent starts `vllm serve`). */
  vllmUrls?: string[] | undefined;
  /** vLLM engine: how it starts `vllm serve` (TB_VLLM_BIN, TB_VLLM_MAX_ADAPTERS, TB_VLLM_START_TIMEOUT_S, TB_VLLM_EXTRA_ARGS). */
  vllm?: { bin?: string | undefined; maxAdapters: number; startTimeoutMs: number; extraArgs: string[]; sleepLevel?: number | undefined } | undefined;
  /** The share of its GPU the engine may use (TB_GPU_MEMORY); unset: the engine's own. */
  gpuMemory?: number | undefined;
  /** GPU turns with the other agents on its GPU (TB_GPU_TURNS, TB_GPU_TURN_MAX_MS; workers/gpu-turns.ts); unset: none. */
  gpuTurns?: { gpu: string; maxTurnMs: number } | undefined;
  /** Liveness timeout in seconds. @defaultValue 30 */
  agentTimeoutS?: number | undefined;
  /** Engine time limit per op kind, in seconds (defaults: `DEFAULT_OP_TIMEOUTS_S`). */
  opTimeoutsS?: Record<string, number> | undefined;
  /** BullMQ job lock in ms. @defaultValue 30000 */
  jobLockMs?: number | undefined;
  /** Seconds a drain's saved models wait for the agent's restart. @defaultValue 3600 */
  drainKeepS?: number | undefined;
  /** Continuous snapshots (workers/snapshots.ts; TB_SNAPSHOT_*); unset: none. */
  snapshots?: { everySteps: number; everyS: number; keep: number } | undefined;
  /** Most forward_backward ops in one engine pass (TB_COBATCH_MAX). @defaultValue 1 */
  cobatchMax?: number | undefined;
  /** Co-batching's gather window in ms (TB_COBATCH_WAIT_MS). @defaultValue 0 */
  cobatchWaitMs?: number | undefined;
  /** The Python engines' settings (`EngineEnv`), which the adapters pass to the engine. @defaultValue every default */
  engineSettings?: EngineSettings | undefined;
};

/** How long one op may keep the engine busy before the agent declares it hung and kills it, in seconds. */
export const DEFAULT_OP_TIMEOUTS_S: Record<string, number> = {
  create_model: 600,
  forward_backward: 1800,
  optim_step: 600,
  save_weights_for_sampler: 900,
  save_weights: 900,
  load_weights: 900,
  save_weights_external: 900,
  unload_model: 300,
  sample: 1800,
};

function parseOpTimeouts(items: string[]): Record<string, number> {
  const out: Record<string, number> = {};
  for (const item of items) {
    const [op, v] = item.split('=');
    const n = Number(v);
    if (!op || !(op in DEFAULT_OP_TIMEOUTS_S) || !Number.isFinite(n) || n <= 0)
      throw new Error(`invalid configuration:\n  TB_OP_TIMEOUTS: '${item}' is not op=seconds with op one of ${Object.keys(DEFAULT_OP_TIMEOUTS_S).join(', ')}`);
    out[op] = n;
  }
  return out;
}

function parseEnv<S extends z.ZodType>(schema: S, env: NodeJS.ProcessEnv): z.output<S> {
  const res = schema.safeParse(env);
  if (!res.success) {
    const lines = res.error.issues.map((i) => `  ${i.path.join('.')}: ${i.message}`);
    throw new Error(`invalid configuration:\n${lines.join('\n')}`);
  }
  return res.data;
}

/** The environment over a preset's values: an unset (or empty) variable leaves the preset's. */
function over(defaults: EnvDefaults, env: NodeJS.ProcessEnv): NodeJS.ProcessEnv {
  const set = Object.entries(env).filter(([, v]) => v !== undefined && v !== '');
  return { ...defaults, ...Object.fromEntries(set) };
}

function common(e: z.output<typeof CommonEnv>): CommonConfig {
  return { redisUrl: e.REDIS_URL, prefix: e.TB_PREFIX, storageDir: path.resolve(e.TB_STORAGE_DIR), retentionS: e.TB_FUTURE_RETENTION_S };
}

/** Where a deployment's Redis and storage are (tools that only read its state: drain, inspect). */
export function loadCommonConfig(env: NodeJS.ProcessEnv = process.env, defaults: EnvDefaults = {}): CommonConfig {
  return common(parseEnv(CommonEnv, over(defaults, env)));
}

export function loadLauncherConfig(env: NodeJS.ProcessEnv = process.env): { stopGraceS: number | undefined; redisDir: string } {
  const e = parseEnv(LauncherEnv, env);
  return { stopGraceS: e.TB_STOP_GRACE_S, redisDir: e.TB_REDIS_DIR };
}

export function loadApiConfig(env: NodeJS.ProcessEnv = process.env, defaults: EnvDefaults = {}): ApiConfig {
  const e = parseEnv(ApiEnv, over(defaults, env));
  return {
    ...common(e),
    host: e.TB_HOST,
    port: e.TB_PORT,
    apiKeys: e.TB_API_KEYS,
    longPollMs: e.TB_LONG_POLL_MS,
    sampleRetrieveFutures: e.TB_SAMPLE_RETRIEVE_FUTURES,
    requiredModels: e.TB_REQUIRED_MODELS,
    maxQueuedSamples: e.TB_MAX_QUEUED_SAMPLES,
    seqWindow: e.TB_SEQ_WINDOW,
    seqGapTimeoutMs: Math.round(e.TB_SEQ_GAP_TIMEOUT_S * 1000),
    resultTtlAfterReadS: e.TB_RESULT_TTL_AFTER_READ_S,
    maxTrainBodyMb: e.TB_MAX_TRAIN_BODY_MB,
    adminKeys: e.TB_ADMIN_KEYS?.length ? e.TB_ADMIN_KEYS : undefined,
    tenantMax: { sessions: e.TB_TENANT_MAX_SESSIONS, models: e.TB_TENANT_MAX_MODELS, samplers: e.TB_TENANT_MAX_SAMPLING_SESSIONS, ckpts: e.TB_TENANT_MAX_CHECKPOINTS },
  };
}

/** `path[=alias]` → a base model whose canonical name is its absolute path. */
export function parseModelSpec(spec: string): BaseModelSpec {
  const [p, ...aliases] = spec.split('=');
  const abs = path.resolve(p ?? '');
  return { name: abs, path: abs, aliases: aliases.filter(Boolean), ...MODEL_DEFAULTS };
}

/**
 * An agent's configuration. Its models: `TB_AGENT_MODELS` when set (frozen on an engine that does not
 * train), else the preset's `models`; one of the two is required. `engines`: the registered engines
 * (workers/adapters/registry.ts engineCatalogue), which TB_ENGINE is checked against.
 */
export function loadAgentConfig(
  env: NodeJS.ProcessEnv = process.env,
  preset?: { defaults: EnvDefaults; models: BaseModelSpec[] },
  engines?: EngineCatalogue,
): AgentConfig {
  // With the engines known, TB_ENGINE must name one (its default the registered default); without, the agent checks it as it starts.
  const schema = engines ? AgentEnv.extend({ TB_ENGINE: z.enum(engines.kinds as [string, ...string[]]).default(engines.default) }) : AgentEnv;
  const e = parseEnv(schema, over(preset?.defaults ?? {}, env));
  const trains = !e.TB_ENGINE || !engines || engines.trains(e.TB_ENGINE);
  const fromEnv = e.TB_AGENT_MODELS?.map((s) => ({ ...parseModelSpec(s), ...(trains ? {} : { trainable: false }) }));
  const models = fromEnv ?? preset?.models;
  if (!models) throw new Error('invalid configuration:\n  TB_AGENT_MODELS: name at least one base model directory');
  const venvPython = path.resolve('.venv/bin/python');
  return {
    ...common(e),
    agentId: e.TB_AGENT_ID ?? `${os.hostname()}-${process.pid}`.replace(/[^a-zA-Z0-9_.-]/g, '-'),
    models,
    python: e.TB_PYTHON ?? (existsSync(venvPython) ? venvPython : 'python3'),
    engineDevice: e.TB_ENGINE_DEVICE || undefined,
    sampleConcurrency: e.TB_SAMPLE_CONCURRENCY,
    sampleGatherMs: e.TB_SAMPLE_GATHER_MS,
    sampleHoldMs: e.TB_SAMPLE_HOLD_MS,
    sampleBatchTokens: e.TB_SAMPLE_BATCH_TOKENS,
    engineRestart: e.TB_ENGINE_RESTART,
    engineThreads: e.TB_ENGINE_THREADS ?? (e.TB_ENGINE_DEVICE === 'cpu' && !env.OMP_NUM_THREADS ? Math.max(1, os.availableParallelism() - 1) : undefined),
    engine: e.TB_ENGINE,
    vllmUrls: e.TB_VLLM_URL?.length ? e.TB_VLLM_URL : undefined,
    vllm: { bin: e.TB_VLLM_BIN, maxAdapters: e.TB_VLLM_MAX_ADAPTERS, startTimeoutMs: e.TB_VLLM_START_TIMEOUT_S * 1000, extraArgs: e.TB_VLLM_EXTRA_ARGS, sleepLevel: e.TB_VLLM_SLEEP_LEVEL },
    gpuMemory: e.TB_GPU_MEMORY,
    gpuTurns: e.TB_GPU_TURNS ? { gpu: e.TB_GPU_TURNS, maxTurnMs: e.TB_GPU_TURN_MAX_MS } : undefined,
    agentTimeoutS: e.TB_AGENT_TIMEOUT_S,
    opTimeoutsS: parseOpTimeouts(e.TB_OP_TIMEOUTS),
    jobLockMs: e.TB_JOB_LOCK_MS,
    drainKeepS: e.TB_DRAIN_KEEP_S,
    snapshots: { everySteps: e.TB_SNAPSHOT_EVERY_STEPS, everyS: e.TB_SNAPSHOT_EVERY_S, keep: e.TB_SNAPSHOT_KEEP },
    cobatchMax: e.TB_COBATCH_MAX,
    cobatchWaitMs: e.TB_COBATCH_WAIT_MS,
    engineSettings: Object.fromEntries(ENGINE_SETTING_NAMES.map((name) => [name, e[name as keyof EngineSettings]])) as EngineSettings,
  };
}
