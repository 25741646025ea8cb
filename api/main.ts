import type { Server } from 'node:http';
import { loadApiConfig, type ApiConfig } from '../queues/infra/config.js';
import { logger } from '../queues/infra/logger.js';
import { buildApp, listen } from './app.js';
import { assertSafeKeys, StartRefused } from './auth.js';

/** The API process: `tsx api/main.ts`. Configuration from the environment (queues/infra/config.ts) or a preset's plan. */
export async function startApi(
  from: { config: ApiConfig } | { env: NodeJS.ProcessEnv } = { env: process.env },
  opts: { localAgentsReady?: () => boolean } = {},
): Promise<{ server: Server; port: number; stop: () => Promise<void> }> {
  const config = 'config' in from ? from.config : loadApiConfig(from.env);
  assertSafeKeys(config, 'env' in from ? from.env : process.env);
  const built = buildApp(config, opts);
  const { close } = built;
  const server = await listen(built, config.port, config.host);
  const addr = server.address();
  const port = typeof addr === 'object' && addr ? addr.port : config.port;
  logger.info('api listening', { url: `http://${config.host}:${port}/api/v1`, prefix: config.prefix });
  const stop = async () => {
    server.closeIdleConnections();
    const closed = new Promise<void>((resolve) => server.close(() => resolve()));
    // Long-polls end within the long-poll window; don't wait longer than that.
    const grace = setTimeout(() => server.closeAllConnections(), Math.min(config.longPollMs, 10_000));
    await closed;
    clearTimeout(grace);
    await close();
  };
  return { server, port, stop };
}

if (import.meta.url === `file://${process.argv[1]}`) {
  startApi()
    .then(({ stop }) => {
      const shutdown = (sig: string) => {
        logger.info('api stopping', { signal: sig });
        const force = setTimeout(() => process.exit(1), 15_000);
        force.unref();
        stop().then(() => process.exit(0), () => process.exit(1));
      };
      process.on('SIGTERM', () => shutdown('SIGTERM'));
      process.on('SIGINT', () => shutdown('SIGINT'));
    })
    .catch((err) => {
      if (err instanceof StartRefused) process.stderr.write(`${err.message}\n`);
      else logger.error('api failed to start', { error: String(err?.stack ?? err) });
      process.exit(err instanceof StartRefused ? 2 : 1);
    });
}
