import type { Server } from 'node:http';
import { loadApiConfig, type ApiConfig } from '../queues/config.js';
import { logger } from '../queues/logger.js';
import { buildApp } from './app.js';
import { DEFAULT_API_KEY } from './auth.js';

const LOOPBACK = new Set(['127.0.0.1', '::1', 'localhost', '::ffff:127.0.0.1']);

/**
 * The API refuses to listen beyond loopback with the well-known default key unless the operator
 * chose the keys (TB_API_KEYS): anyone who can reach the port would otherwise be a tenant.
 */
export class StartRefused extends Error {
  override readonly name = 'StartRefused';
}

export function assertSafeKeys(config: Pick<ApiConfig, 'host' | 'apiKeys'>, env: NodeJS.ProcessEnv): void {
  const loopback = LOOPBACK.has(config.host) || /^127\./.test(config.host);
  if (!loopback && config.apiKeys.includes(DEFAULT_API_KEY) && !env.TB_API_KEYS)
    throw new StartRefused(
      `refusing to listen on ${config.host} with the well-known default API key '${DEFAULT_API_KEY}': set TB_API_KEYS to your own keys (comma separated), or listen on 127.0.0.1`,
    );
}

/** The API process: `tsx api/main.ts`. Configuration from the environment (queues/config.ts) or a preset's plan. */
export async function startApi(
  from: { config: ApiConfig } | { env: NodeJS.ProcessEnv } = { env: process.env },
): Promise<{ server: Server; port: number; stop: () => Promise<void> }> {
  const config = 'config' in from ? from.config : loadApiConfig(from.env);
  assertSafeKeys(config, 'env' in from ? from.env : process.env);
  const { app, close } = buildApp(config);
  const server = await new Promise<Server>((resolve, reject) => {
    const s = app.listen(config.port, config.host, (err?: Error) => (err ? reject(err) : resolve(s)));
  });
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
