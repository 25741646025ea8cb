import type { ServedModel } from '../../queues/registry/agents.js';
import type {
  CreateModelJob,
  ForwardBackwardJob,
  ForwardBackwardResult,
  OptimStepJob,
  SampleJob,
  SampleResult,
  SaveSamplerJob,
} from '../../queues/contract/schemas.js';
import type { BaseModelSpec, SampleFeature } from '../../queues/infra/config.js';
import type { TurnStats } from '../gpu-turns.js';

/**
 * What an agent needs from an engine: one method per Tinker operation. Each engine has one adapter
 * that translates jobs into its calls, and registers the engine with what it can do
 * (workers/adapters/registry.ts); the agent reads its capabilities there by `kind`.
 */
export interface EngineAdapter {
  /** The registered engine this adapter drives (workers/adapters/registry.ts). */
  readonly kind: string;
  readonly device: string;
  /**
   * Sample-request features this adapter cannot answer on its device, beyond its engine's
   * registered `sampleLacks`; the agent publishes both in its record, for routing.
   */
  readonly sampleLacks?: readonly SampleFeature[];
  start(): Promise<void>;
  stop(): Promise<void>;
  loadBase(spec: BaseModelSpec): Promise<ServedModel>;
  createModel(job: CreateModelJob): Promise<{ model_id: string }>;
  forwardBackward(job: ForwardBackwardJob): Promise<ForwardBackwardResult>;
  /**
   * Several models' forward_backward on one base model in one pass of the engine (co-batching):
   * each member's result, or its own error (a user error of one member does not fail the others).
   * Absent: the engine runs them one at a time.
   */
  forwardBackwardGroup?(jobs: ForwardBackwardJob[]): Promise<(ForwardBackwardResult | Error)[]>;
  optimStep(job: OptimStepJob): Promise<{ metrics: Record<string, number> }>;
  /** Writes the sampler version's PEFT adapter into `job.dir` (which must not exist); returns its size. */
  saveSampler(job: SaveSamplerJob): Promise<{ size_bytes: number }>;
  /** Writes the training state (adapter, optionally optimizer, and for a drain the accumulated gradients) into `dir` (which must not exist). */
  saveState(modelId: string, dir: string, optimizer: boolean, gradients?: boolean): Promise<{ size_bytes: number }>;
  /** Loads a training checkpoint into an existing model; without `optimizer` the Adam state starts fresh. */
  loadState(modelId: string, dir: string, optimizer: boolean, gradients?: boolean): Promise<void>;
  unloadModel(modelId: string): Promise<void>;
  /**
   * A continuous snapshot (workers/snapshots.ts): the model's state is copied now and written to
   * `root/<seqId>` while training goes on; the newest `keep` stay. Absent: the engine takes none.
   */
  snapshot?(modelId: string, root: string, seqId: number, keep: number): Promise<{ last_error: string | null }>;
  sample(job: SampleJob): Promise<SampleResult>;
  /**
   * Samples several jobs of one base model in one engine call; one result or one error per job, in
   * order. Required when the engine registers `sampleBatch`; else the agent sends jobs one at a time to `sample`.
   */
  sampleBatch?(jobs: SampleJob[]): Promise<(SampleResult | Error)[]>;
  /** Kills a hung engine at once (SIGKILL); its exit is then reported through `onExit`. */
  kill?(): void;
  /** Process ids of the engine (for its memory in /metrics and `tinker-broker agents`); descendants are found from them. */
  enginePids?(): number[];
  /**
   * GPU turns (workers/gpu-turns.ts), for an engine sharing its GPU with another agent's: gives the
   * GPU memory it can do without back before the other engine's phase (vLLM: sleep mode; torch: its
   * allocator's cached blocks), and takes it again before its own. Absent: nothing to give back.
   */
  releaseGpu?(): Promise<void>;
  reclaimGpu?(): Promise<void>;
  /** The GPU turns taken and given, and their costs, when the adapter takes turns (workers/gpu-turns.ts). */
  turns?(): TurnStats;
  /** Called when the engine died: every model it held is gone. */
  onExit(listener: (reason: string) => void): void;
}
