import { rm } from 'node:fs/promises';
import path from 'node:path';
import type { Redis } from 'ioredis';
import type { AgentConfig } from '../../queues/infra/config.js';
import type { Logger } from '../../queues/infra/logger.js';
import type { Names } from '../../queues/contract/names.js';
import type { Registry } from '../../queues/registry/index.js';
import type { EngineAdapter } from '../adapters/adapter.js';
import type { EngineCapabilities } from '../adapters/registry.js';
import type { EngineSupervisor } from './engine.js';

/**
 * What a drain keeps for the agent's next start, and that start's restore. On an engine that
 * drains (its registered `drains`), every model is saved with its AdamW state and accumulated
 * gradients, and listed in the agent's drain record (TB_DRAIN_KEEP_S); the next start of this agent
 * id reloads them, so their clients go on as if nothing happened. docs/reliability.md has the rest.
 */

export type DrainStateOptions = {
  config: Pick<AgentConfig, 'agentId' | 'storageDir' | 'retentionS' | 'drainKeepS'>;
  log: Logger;
  names: Names;
  redis: Redis;
  registry: Registry;
  adapter: EngineAdapter;
  capabilities: Pick<EngineCapabilities, 'drains'>;
  engine: EngineSupervisor;
  incarnation: string;
};

/** Saves the models loaded here (engines that drain) and records them for the next start; returns their ids. */
export async function saveDrained(o: DrainStateOptions): Promise<string[]> {
  const { config, log, adapter, engine } = o;
  const saved: { model_id: string; dir: string }[] = [];
  if (o.capabilities.drains) {
    for (const m of engine.loaded) {
      const dir = path.join(config.storageDir, 'drain', config.agentId, `${m}-${Date.now()}`);
      try {
        await adapter.saveState(m, dir, true, true);
        saved.push({ model_id: m, dir });
      } catch (e) {
        log.error('could not save a model while draining; it will be unavailable', { model: m, error: String(e) });
      }
    }
  }
  const keepS = config.drainKeepS ?? 3_600;
  // No heartbeat keeps the saved models' records while the agent is away: they outlast the drain record.
  await o.registry.models.keep(saved.map((s) => s.model_id), keepS + config.retentionS);
  await o.redis.set(o.names.agentDrained(config.agentId), JSON.stringify({ models: saved, at: new Date().toISOString(), incarnation: o.incarnation }), 'EX', keepS);
  return saved.map((s) => s.model_id);
}

/**
 * Reloads the models the previous incarnation saved when it drained (weights, AdamW state and
 * accumulated gradients), so their clients go on as if nothing happened; returns their ids.
 */
export async function restoreDrained(o: DrainStateOptions): Promise<Set<string>> {
  const { config, log, adapter, engine, redis, registry } = o;
  const restored = new Set<string>();
  const key = o.names.agentDrained(config.agentId);
  const raw = await redis.get(key);
  if (raw === null) return restored;
  const drained = JSON.parse(raw) as { models: { model_id: string; dir: string }[] };
  for (const d of drained.models) {
    const rec = await registry.models.get(d.model_id);
    if (!rec || rec.agent_id !== config.agentId || rec.lost_reason !== null) continue;
    try {
      await adapter.createModel({ op: 'create_model', model_id: rec.model_id, base_model: rec.base_model, lora: rec.lora });
      await adapter.loadState(rec.model_id, d.dir, true, true);
      engine.loaded.add(rec.model_id);
      restored.add(rec.model_id);
    } catch (e) {
      log.error('a drained model could not be reloaded; it is unavailable', { model: d.model_id, error: String(e) });
    }
    await rm(d.dir, { recursive: true, force: true }).catch(() => undefined);
  }
  await redis.del(key);
  log.info('models reloaded after a drain', { models: [...restored] });
  return restored;
}
