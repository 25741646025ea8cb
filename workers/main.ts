import { loadAgentConfig } from '../queues/infra/config.js';
import { logger } from '../queues/infra/logger.js';
import { engineCatalogue } from './adapters/index.js';
import { Agent } from './agent.js';

/**
 * The worker agent process: `tsx workers/main.ts`. Configuration from the environment.
 * SIGTERM/SIGINT drain the agent (docs/reliability.md): the op in flight finishes, however long the
 * operator's stop grace allows, and every model is saved for the next start. A second signal exits
 * at once without saving.
 */
async function main(): Promise<void> {
  const agent = new Agent(loadAgentConfig(process.env, undefined, engineCatalogue()));
  let signals = 0;
  const shutdown = (sig: string) => {
    if (signals++ > 0) {
      logger.warn('second signal: exiting without finishing the drain', { signal: sig });
      process.exit(1);
    }
    logger.info('agent draining', { signal: sig });
    void agent.drain();
  };
  process.on('SIGTERM', () => shutdown('SIGTERM'));
  process.on('SIGINT', () => shutdown('SIGINT'));
  void agent.stopped.then(() => process.exit(process.exitCode ?? 0));
  await agent.start();
}

main().catch((err) => {
  logger.error('agent failed', { error: String(err?.stack ?? err) });
  process.exit(1);
});
