import type { ChildProcess } from 'node:child_process';
import { startApi } from '../api/main.js';
import { loadAgentConfig } from '../queues/config.js';
import { logger } from '../queues/logger.js';
import { Agent } from '../workers/agent.js';
import { defaultPython, ensureRedis, ensureTinyModel, TINY_MODEL_ALIAS, TINY_MODEL_DIR } from './stack.js';

/**
 * The embedded default: Redis (started when none answers at REDIS_URL), the API, and one
 * worker agent with the tiny CPU model, in one command (`npm start`). Every setting can be
 * overridden by the same environment variables the API and agent read (queues/config.ts).
 */
async function main(): Promise<void> {
  const env: NodeJS.ProcessEnv = { ...process.env };
  env.REDIS_URL ??= 'redis://127.0.0.1:6379';
  env.TB_AGENT_MODELS ??= `${TINY_MODEL_DIR}=${TINY_MODEL_ALIAS}`;
  env.TB_REQUIRED_MODELS ??= env.TB_AGENT_MODELS.split(',').map((s) => s.split('=')[1] ?? s).join(',');
  env.TB_AGENT_ID ??= 'local-0';

  let redis: ChildProcess | null = null;
  redis = await ensureRedis(env.REDIS_URL);
  if (!process.env.TB_AGENT_MODELS) ensureTinyModel(env.TB_PYTHON ?? defaultPython());

  const agent = new Agent(loadAgentConfig(env));
  const api = await startApi(env);
  let stopping = false;
  const shutdown = async (sig: string) => {
    if (stopping) return;
    stopping = true;
    logger.info('stopping', { signal: sig });
    const force = setTimeout(() => process.exit(1), 30_000);
    force.unref();
    await api.stop().catch(() => undefined);
    await agent.stop().catch(() => undefined);
    redis?.kill('SIGTERM');
    process.exit(process.exitCode ?? 0);
  };
  process.on('SIGTERM', () => void shutdown('SIGTERM'));
  process.on('SIGINT', () => void shutdown('SIGINT'));
  await agent.start();
  logger.info('tinker-broker ready', {
    base_url: `http://${env.TB_HOST ?? '127.0.0.1'}:${api.port}`,
    models: env.TB_AGENT_MODELS,
  });
}

main().catch((err) => {
  logger.error('start failed', { error: String(err?.stack ?? err) });
  process.exit(1);
});
