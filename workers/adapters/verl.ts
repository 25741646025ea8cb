import os from 'node:os';
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

/** A model spec as the verl adapter reads it: `dataParallel` is the preset's `parallelism.data` (the ranks FSDP shards over). */
type VerlModelSpec = BaseModelSpec & { dataParallel?: number | undefined };

/**
 * The CPU ranks of an agent whose device is `cpu`: the `parallelism.data` its models set (they must
 * agree); null when none sets it (a verl agent off the GPUs needs it).
 */
export function cpuRanksOf(device: string | undefined, models: VerlModelSpec[]): number | null {
  if (device !== 'cpu') return null;
  const sizes = [...new Set(models.map((m) => m.dataParallel).filter((d): d is number => d !== undefined))];
  if (sizes.length > 1) throw new Error(`one verl engine runs one rank count; the agent's models ask for parallelism.data ${sizes.join(', ')}`);
  const n = sizes[0];
  if (n === undefined) return null;
  if (!Number.isInteger(n) || n < 1) throw new Error(`parallelism.data must be a positive integer, got ${n}`);
  return n;
}

/**
 * How the agent starts the verl engine under torchrun, rank 0 speaking the engine channel
 * (workers/python/tinker_engine_verl):
 * - on GPUs (`cuda`, `cuda:N`, `cuda:N,M,…`): one process per GPU, `CUDA_VISIBLE_DEVICES` set to those GPUs;
 * - on CPU (`cpu` with the models' `parallelism.data` = N): N processes over gloo, no GPU visible,
 *   the machine's cores split between them (OMP_NUM_THREADS, unless the operator set it).
 * The preset's strategy (fsdp2 by default; fsdp; veomni: verl's VeOmni engine, which needs the veomni
 * package beside verl, docs/engines/verl.md) and offload of the agent's models become
 * `TB_VERL_STRATEGY` / `TB_VERL_OFFLOAD`; their `remove_padding` and `gradient_checkpointing`, where set,
 * become `TB_VERL_REMOVE_PADDING` / `TB_VERL_GRAD_CKPT` (over the agent's settings of the same name).
 */
export function verlLaunch(device: string | undefined, models: VerlModelSpec[]): VerlLaunch {
  const gpus = gpusOf(device);
  const cpuRanks = gpus ? null : cpuRanksOf(device, models);
  if (!gpus && !cpuRanks)
    throw new Error(`the verl engine runs on GPUs: device '${device ?? ''}' is not cuda, cuda:N or cuda:N,M,… (on CPU ranks: device cpu and the model's parallelism.data = the rank count)`);
  const strategies = [...new Set(models.map((m) => m.strategy ?? 'fsdp2'))];
  if (strategies.length > 1) throw new Error(`one verl engine runs one strategy; the agent's models ask for ${strategies.join(', ')}`);
  const strategy = strategies[0] ?? 'fsdp2';
  if (!VERL_STRATEGIES.includes(strategy))
    throw new Error(`verl strategy '${strategy}' is not available in this version (${VERL_STRATEGIES.join(', ')} are)`);
  // The padding and checkpointing levers a model's preset sets (else the agent's settings decide).
  const levers: Record<string, string> = {};
  for (const [variable, field, of] of [
    ['TB_VERL_REMOVE_PADDING', 'remove_padding', (m: VerlModelSpec) => m.removePadding],
    ['TB_VERL_GRAD_CKPT', 'gradient_checkpointing', (m: VerlModelSpec) => m.gradientCheckpointing],
  ] as const) {
    const set = [...new Set(models.map(of).filter((v): v is boolean => v !== undefined))];
    if (set.length > 1) throw new Error(`one verl engine runs one ${field} setting; the agent's models ask for both`);
    if (set.length) levers[variable] = set[0] ? '1' : '0';
  }
  const nproc = gpus ? gpus.length : cpuRanks!;
  const threads = process.env.OMP_NUM_THREADS ?? (gpus ? '4' : String(Math.max(1, Math.floor(os.availableParallelism() / nproc))));
  return {
    nproc,
    args: ['-m', 'torch.distributed.run', '--standalone', `--nproc_per_node=${nproc}`, '-m', 'tinker_engine_verl'],
    env: {
      // On CPU ranks no GPU is visible: the engine picks gloo and verl's CPU platform (tinker_engine_verl/cpu.py).
      CUDA_VISIBLE_DEVICES: gpus ? gpus.join(',') : '',
      TB_VERL_STRATEGY: strategy,
      TB_VERL_OFFLOAD: models.some((m) => m.offload) ? '1' : '0',
      ...levers,
      OMP_NUM_THREADS: threads,
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
    // The launch's levers, set by the models' presets, win over the agent's settings of the same name.
    const fromModels = Object.fromEntries(Object.entries(launch.env).filter(([k]) => k.startsWith('TB_VERL_')));
    super({ python: opts.python, device: undefined, log: opts.log, launch, env: { ...engineSettingsEnv(opts.settings), ...fromModels } });
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
    placement: "shards the model over its agent's GPUs (or parallelism.data CPU ranks) with FSDP",
    modelOptions: ['data', 'strategy', 'offload', 'remove_padding', 'gradient_checkpointing'],
  },
  create: (config, log) => new VerlAdapter({ python: config.python, device: config.engineDevice, log, models: config.models, settings: config.engineSettings }),
  // FSDP shards a model over every GPU of its agent: a preset's data size, when given, is their count
  // (on a `cpu` agent it is the number of CPU ranks, verlLaunch).
  presetProblems: (m, agents) => {
    const out: PresetProblem[] = [];
    // tinker_engine_verl/levers.py keeps padding under the VeOmni strategy (its packed path is not wired).
    if (m.remove_padding && m.parallelism.strategy === 'veomni') out.push([['remove_padding'], "verl's veomni strategy keeps padding in this version (fsdp2 and fsdp remove it)"]);
    const data = m.parallelism.data;
    if (data === undefined) return out;
    return out.concat(agents
      .filter((a) => a.n > 0 && a.n !== data)
      .map((a): PresetProblem => [['parallelism', 'data'], `data ${data}, but agent '${a.id}' runs this model on ${a.n} GPU(s) (${a.device}): verl shards it over every GPU of its agent`]));
  },
});
