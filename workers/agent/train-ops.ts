import type { TrainJob } from '../../queues/contract/schemas.js';
import { requireCheckpointRecord } from '../../queues/runtime/checkpoints.js';
import type { Registry } from '../../queues/registry/index.js';
import type { EngineAdapter } from '../adapters/adapter.js';
import type { CheckpointJobs } from '../checkpoint-jobs.js';
import type { AgentSnapshots } from '../snapshots.js';
import type { EngineSupervisor } from './engine.js';

/**
 * What each training op does, once its turn on the engine has come (workers/agent/training.ts): its
 * adapter call, with the checks and records around it (the model lives in this engine, a checkpoint
 * exists, a model unloaded is marked lost, a snapshot after an optim_step when one is due).
 */
export async function trainOp(
  data: TrainJob,
  {
    adapter,
    engine,
    registry,
    checkpoints,
    snapshots,
  }: { adapter: EngineAdapter; engine: EngineSupervisor; registry: Pick<Registry, 'models' | 'checkpoints'>; checkpoints: CheckpointJobs; snapshots?: AgentSnapshots | undefined },
): Promise<unknown> {
  switch (data.op) {
    case 'create_model': {
      const r = await adapter.createModel(data);
      engine.loaded.add(data.model_id);
      return r;
    }
    case 'forward_backward':
      await engine.requireLoaded(data.model_id);
      return adapter.forwardBackward(data);
    case 'optim_step': {
      await engine.requireLoaded(data.model_id);
      const r = await adapter.optimStep(data);
      // Before the next op takes the engine: only the state's copy waits (workers/snapshots.ts).
      await snapshots?.afterOptimStep(data.model_id, data.seq_id);
      return r;
    }
    case 'save_weights_for_sampler':
      await engine.requireLoaded(data.model_id);
      return checkpoints.saveSampler(data);
    case 'save_weights':
      await engine.requireLoaded(data.model_id);
      return checkpoints.saveState(data);
    case 'load_weights': {
      await engine.requireLoaded(data.model_id);
      await requireCheckpointRecord(registry.checkpoints, data.tinker_path);
      await adapter.loadState(data.model_id, data.dir, data.optimizer);
      return { path: data.tinker_path, model_id: data.model_id };
    }
    case 'save_weights_external':
      await engine.requireLoaded(data.model_id);
      return checkpoints.saveExternal(data);
    case 'unload_model':
      if (engine.loaded.has(data.model_id)) await adapter.unloadModel(data.model_id);
      engine.loaded.delete(data.model_id);
      await registry.models.markLost(data.model_id, 'it was unloaded (unload_model)');
      await snapshots?.drop(data.model_id);
      return { model_id: data.model_id };
  }
}
