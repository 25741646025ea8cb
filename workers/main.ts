import { loadAgentConfig } from '../queues/config.js';
import { logger } from '../queues/logger.js';
import { Agent } from './agent.js';

/** The worker agent process: `tsx workers/main.ts`. Configuration from the environment. */
async function main(): Promise<void> {
  const agent = new Agent(loadAgentConfig());
  const shutdown = (sig: string) => {
    logger.info('agent stopping', { signal: sig });
    const force = setTimeout(() => process.exit(1), 60_000);
    force.unref();
    agent.stop().then(() => process.exit(process.exitCode ?? 0), () => process.exit(1));
  };
  process.on('SIGTERM', () => shutdown('SIGTERM'));
  process.on('SIGINT', () => shutdown('SIGINT'));
  await agent.start();
}

main().catch((err) => {
  logger.error('agent failed', { error: String(err?.stack ?? err) });
  process.exit(1);
});
