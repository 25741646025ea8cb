import { loadCommonConfig } from '../queues/infra/config.js';
import { Names } from '../queues/contract/names.js';
import { connect } from '../queues/infra/redis.js';
import { AgentRegistry } from '../queues/registry/agents.js';

export type DrainResult = { agent_id: string; status: 'drained' | 'not_live' | 'timeout'; models_saved?: number; seconds?: number };

/**
 * What `tinker-broker drain` does: sets each agent's drain request in Redis (the agent's next
 * heartbeat takes it), then waits until the agent has released its liveness key and left its drain
 * record (the models it saved).
 */
export async function drainAgents(env: NodeJS.ProcessEnv, agentIds: string[], timeoutS: number): Promise<DrainResult[]> {
  const config = loadCommonConfig(env);
  const redis = connect(config.redisUrl, 'producer');
  try {
    const names = new Names(config.prefix);
    const live = new Map((await new AgentRegistry(redis, names).live()).map((a) => [a.agent_id, a]));
    const targets = agentIds.length ? agentIds : [...live.keys()];
    const out: DrainResult[] = [];
    await Promise.all(
      targets.map(async (id) => {
        const rec = live.get(id);
        if (!rec) return out.push({ agent_id: id, status: 'not_live' });
        const t0 = Date.now();
        await redis.set(names.agentDrainRequest(id), '1', 'EX', Math.ceil(timeoutS));
        const alive = names.agentAlive(id);
        while (Date.now() - t0 < timeoutS * 1000) {
          const v = await redis.get(alive);
          const drained = await redis.get(names.agentDrained(id));
          if ((v === null || !v.startsWith(`${rec.incarnation} `)) && drained !== null) {
            const d = JSON.parse(drained) as { models: unknown[]; incarnation?: string };
            if (d.incarnation === rec.incarnation)
              return out.push({ agent_id: id, status: 'drained', models_saved: d.models.length, seconds: (Date.now() - t0) / 1000 });
          }
          await new Promise((r) => setTimeout(r, 200));
        }
        await redis.del(names.agentDrainRequest(id));
        return out.push({ agent_id: id, status: 'timeout' });
      }),
    );
    return out;
  } finally {
    redis.disconnect();
  }
}
