import { deviceGpus, engineSettingsEnv, type BaseModelSpec, type EngineSettings } from '../../queues/infra/config.js';
import type { Logger } from '../../queues/infra/logger.js';
import { EngineError } from '../engine.js';
import { registerEngine, type PresetProblem } from './registry.js';
import { TorchAdapter } from './torch.js';
import type { SampleJob, SampleResult } from '../../queues/contract/schemas.js';

/** The GPUs of an agent's device (`cuda` = the first one, `cuda:N`, `cuda:N,M,…`); null for anything else. */
export function gpusOf(device: string | undefined): number[] | null {
  const gpus = deviceGpus(device);
  return gpus.length ? gpus : null;
}

const VERL_KIND = 'verl';

/** The strategies the verl engine runs (`STRATEGIES` in workers/python/tinker_engine_verl/settings.py). */
export const VERL_STRATEGIES: readonly string[] = ['fsdp2', 'fsdp', 'veomni'];

export type VerlLaunch = { args: string[]; env: NodeJS.ProcessEnv; nproc: number };

/**
 * How the agent starts the verl engine: one process per GPU of the agent's device under torchrun,
 * `CUDA_VISIBLE_DEVICES` set to those GPUs; rank 0 speaks the engine channel (workers/python/tinker_engine_verl).
 * The preset's strategy (fsdp2 by default; fsdp; veomni: verl's VeOmni engine, which needs the veomni
 * package beside verl, docs/engines/verl.md) and offload of the agent's models become
 * `TB_VERL_STRATEGY` / `TB_VERL_OFFLOAD`.
 */
export function verlLaunch(device: string | undefined, models: BaseModelSpec[]): VerlLaunch {
  const gpus = gpusOf(device);
  if (!gpus) throw new Error(`the verl engine runs on GPUs: device '${device ?? ''}' is not cuda, cuda:N or cuda:N,M,…`);
  const strategies = [...new Set(models.map((m) => m.strategy ?? 'fsdp2'))];
  if (strategies.length > 1) throw new Error(`one verl engine runs one strategy; the agent's models ask for ${strategies.join(', ')}`);
  const strategy = strategies[0] ?? 'fsdp2';
  if (!VERL_STRATEGIES.includes(strategy))
    throw new Error(`verl strategy '${strategy}' is not available in this version (${VERL_STRATEGIES.join(', ')} are)`);
  const nproc = gpus.length;
  return {
    nproc,
    args: ['-m', 'torch.distributed.run', '--standalone', `--nproc_per_node=${nproc}`, '-m', 'tinker_engine_verl'],
    env: {
      CUDA_VISIBLE_DEVICES: gpus.join(','),
      TB_VERL_STRATEGY: strategy,
      TB_VERL_OFFLOAD: models.some((m) => m.offload) ? '1' : '0',
      OMP_NUM_THREADS: process.env.OMP_NUM_THREADS ?? '4',
    },
  };
}

/**
 * The verl engine (verl's FSDP engine, LoRA, one process per GPU): the torch engine's protocol for
 * the training ops (docs/engine-protocol.md), so the job translation is the torch adapter's. It
 * does not sample: sample jobs of its models go to vLLM or torch agents serving the same base.
 */
export class VerlAdapter extends TorchAdapter {
  override readonly kind: string = VERL_KIND;

  constructor(opts: { python: string; device?: string | undefined; log: Logger; models: BaseModelSpec[]; settings?: EngineSettings | undefined }) {
    const launch = verlLaunch(opts.device, opts.models);
    // The engine picks its device from CUDA_VISIBLE_DEVICES and LOCAL_RANK, not TB_ENGINE_DEVICE.
    super({ python: opts.python, device: undefined, log: opts.log, launch, env: engineSettingsEnv(opts.settings) });
  }

  override sample(_job: SampleJob): Promise<SampleResult> {
    return Promise.reject(new EngineError('server', 'the verl engine trains only; sample through a vLLM or torch agent'));
  }
}

/** verl's FSDP engine over the agent's GPUs: trains only; its models' samples go to vLLM or torch agents. */
export const VERL_ENGINE = registerEngine({
  kind: VERL_KIND,
  capabilities: {
    trains: true,
    samples: false,
    sampleLacks: [],
    sampleBatch: false,
    samplePriority: 0,
    drains: false,
    gpuOnly: true,
    placement: "shards the model over its agent's GPUs with FSDP",
    modelOptions: ['data', 'strategy', 'offload'],
  },
  create: (config, log) => new VerlAdapter({ python: config.python, device: config.engineDevice, log, models: config.models, settings: config.engineSettings }),
  // FSDP shards a model over every GPU of its agent: a preset's data size, when given, is their count.
  presetProblems: (m, agents) => {
    const data = m.parallelism.data;
    if (data === undefined) return [];
    return agents
      .filter((a) => a.n > 0 && a.n !== data)
      .map((a): PresetProblem => [['parallelism', 'data'], `data ${data}, but agent '${a.id}' runs this model on ${a.n} GPU(s) (${a.device}): verl shards it over every GPU of its agent`]);
  },
});
