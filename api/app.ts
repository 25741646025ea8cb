import { randomUUID } from 'node:crypto';
import { readFileSync } from 'node:fs';
import { createServer, type IncomingMessage, type Server, type ServerOptions, type ServerResponse } from 'node:http';
import express, { type Express, type RequestHandler } from 'express';
import type { Redis } from 'ioredis';
import type { ApiConfig } from '../queues/infra/config.js';
import { OrderingGate } from '../queues/runtime/gate.js';
import { logger } from '../queues/infra/logger.js';
import { Names } from '../queues/contract/names.js';
import { QueueSet } from '../queues/runtime/queues.js';
import { connect } from '../queues/infra/redis.js';
import { Registry } from '../queues/registry/index.js';
import { pruneListings } from '../queues/registry/listings.js';
import { apiKeyAuth } from './auth.js';
import type { ApiContext } from './context.js';
import { errorHandler, notFoundHandler, redisUnavailable } from './errors.js';
import { FutureResolver } from './futures.js';
import { startCheckpointSweeper } from './services/checkpoints.js';
import { futureRoutes } from './routes/futures.js';
import { sessionFutureRoutes } from './routes/session-futures.js';
import { checkpointRoutes } from './routes/checkpoints.js';
import { sessionRoutes } from './routes/sessions.js';
import { modelRoutes } from './routes/models.js';
import { samplingRoutes } from './routes/sampling.js';
import { healthHandler, serviceRoutes } from './routes/service.js';
import { trainingRoutes, unknownEndpointGuard } from './routes/training.js';
import { customLossRoutes } from './routes/custom-loss.js';
import { fileDownloadHandler } from './file-urls.js';
import { ADMIN_PATH, adminRoutes } from './admin.js';
import { metricsHandler } from './metrics.js';
import { openApiDocument } from './openapi.js';
import { forwardBackwardBody } from './train-body.js';
import { jsonBody, sendJson } from './json-body.js';
import { DirectRoutes } from './direct.js';

const VERSION: string = JSON.parse(readFileSync(new URL('../package.json', import.meta.url), 'utf8')).version;

/**
 * Builds the Express app of the Tinker HTTP API. Every route lives under `/api/v1` and is
 * found in `routes/<resource>.ts`; `close()` releases the Redis connections. Beside it:
 * `/healthz`, `/metrics` (Prometheus, api/metrics.ts), `/admin` (queue dashboard, api/admin.ts)
 * and `/api/v1/openapi.json` (api/openapi.ts).
 */
export type BuiltApp = {
  app: Express;
  /** The HTTP server's request listener: the hot routes served directly (api/direct.ts), the rest by `app`. */
  listener: (req: IncomingMessage, res: ServerResponse) => void;
  /** The HTTP server's request and response classes (api/direct.ts DirectRoutes.serverOptions). */
  serverOptions: ServerOptions;
  ctx: ApiContext;
  close: () => Promise<void>;
};

/** Serves a built app on `port` (0: any free one) and `host`. */
export function listen(built: BuiltApp, port: number, host: string): Promise<Server> {
  return new Promise<Server>((resolve, reject) => {
    const server = createServer(built.serverOptions, built.listener);
    server.once('error', reject);
    server.listen(port, host, () => {
      server.off('error', reject);
      resolve(server);
    });
  });
}

/**
 * Logs a connection's errors (ioredis emits 'error' on every failed reconnect; without a listener
 * it prints them as unhandled) once per outage, and the recovery.
 */
const redisDown = new WeakSet<Redis>();
function watch(c: Redis, role: string): Redis {
  let logged = false;
  c.on('error', (err: Error) => {
    redisDown.add(c);
    if (logged) return;
    logged = true;
    logger.warn('redis unreachable', { role, error: err.message });
  });
  // A closed connection counts as down at once; reconnecting and failing then logs the error.
  c.on('close', () => redisDown.add(c));
  c.on('ready', () => {
    redisDown.delete(c);
    if (!logged) return;
    logged = false;
    logger.info('redis reachable again', { role });
  });
  return c;
}

/** How often the listing sweep runs: a quarter of the retention, between 1 s and 60 s. */
export function listingSweepMs(retentionS: number): number {
  return Math.min(60_000, Math.max(1_000, Math.round(retentionS * 250)));
}

export function buildApp(config: ApiConfig, opts: { localAgentsReady?: () => boolean } = {}): BuiltApp {
  const redis: Redis = watch(connect(config.redisUrl, 'producer'), 'producer');
  const blocking: Redis[] = [];
  const names = new Names(config.prefix);
  const registry = new Registry(redis, names);
  const queues = new QueueSet(redis, names, config.retentionS);
  const gate = new OrderingGate(redis, names, queues, {
    window: config.seqWindow,
    gapTimeoutMs: config.seqGapTimeoutMs,
    failedTtlS: config.retentionS,
    modelTtlS: config.retentionS,
  });
  const futures = new FutureResolver(
    redis,
    () => {
      const c = watch(connect(config.redisUrl, 'blocking'), 'blocking');
      blocking.push(c);
      return c;
    },
    names,
    queues,
    gate,
    registry,
    config.retentionS,
    config.resultTtlAfterReadS,
  );
  const ctx: ApiContext = { config, redis, names, registry, queues, gate, futures, ...(opts.localAgentsReady ? { localAgentsReady: opts.localAgentsReady } : {}) };

  const app = express();
  app.disable('x-powered-by');
  // No ETag: every answer is fresh JSON or protobuf that no client revalidates, and Express would
  // hash each body for it (a whole forward or sample result included).
  app.set('etag', false);
  // Every request gets an id (the caller's X-Request-Id, or a new one), echoed in the reply and
  // carried by its log lines with the model and the future (queue/job) it touched.
  const requestContext: RequestHandler = (req, res, next) => {
    const start = Date.now();
    const requestId = /^[\w.:-]{1,128}$/.test(req.header('x-request-id') ?? '') ? req.header('x-request-id')! : randomUUID();
    res.setHeader('x-request-id', requestId);
    res.locals.log = logger.child({ requestId });
    let future: string | undefined;
    let modelId: string | undefined;
    // Every JSON answer is written by sendJson (api/json-body.ts), in place of Express's res.json.
    res.json = (body: unknown) => {
      const b = body as { request_id?: unknown; model_id?: unknown } | null;
      if (b && typeof b.request_id === 'string') future = b.request_id;
      if (b && typeof b.model_id === 'string') modelId = b.model_id;
      return sendJson(req, res, body);
    };
    res.on('finish', () => {
      if (req.path === '/api/v1/retrieve_future' && res.statusCode < 400) return;
      const level = res.statusCode >= 500 ? 'warn' : res.statusCode >= 400 ? 'info' : 'debug';
      const bodyModel = (req.body as { model_id?: unknown } | undefined)?.model_id;
      res.locals.log.log(level, 'http', {
        method: req.method,
        path: req.path,
        status: res.statusCode,
        ms: Date.now() - start,
        ...((modelId ?? (typeof bodyModel === 'string' ? bodyModel : undefined)) ? { modelId: modelId ?? bodyModel } : {}),
        ...(future ? { future } : {}),
      });
    });
    next();
  };
  // While Redis is unreachable every route (healthz included) answers 503 with Retry-After at once,
  // instead of waiting for the command to give up; the error handler maps errors that slip through.
  const redisCheck: RequestHandler = (_req, _res, next) => next(redisDown.has(redis) || redis.status === 'end' ? redisUnavailable() : undefined);
  const auth = apiKeyAuth(config.apiKeys);
  // forward_backward's protobuf body is read first, watched while it arrives: a datum past every
  // served model's bounds is refused after its first bytes, not after buffering the whole body.
  const fbBody = forwardBackwardBody(ctx);
  const json = jsonBody(64 * 2 ** 20);
  // The hot routes are also served without Express's router, behind the same middleware (api/direct.ts).
  const direct = new DirectRoutes();
  const v1Before = (path: string): RequestHandler[] => [auth, ...(path === '/forward_backward' ? [fbBody] : []), json];
  app.use(requestContext);
  app.use(redisCheck);
  const v1 = express.Router();
  v1.use(auth);
  v1.post('/forward_backward', fbBody);
  v1.use(json);
  v1.use(serviceRoutes(ctx));
  v1.use(sessionRoutes(ctx));
  v1.use(modelRoutes(ctx));
  v1.use(trainingRoutes(ctx, direct));
  v1.use(customLossRoutes(ctx));
  v1.use(samplingRoutes(ctx, direct));
  v1.use(futureRoutes(ctx, direct));
  v1.use(sessionFutureRoutes(ctx, direct));
  v1.use(checkpointRoutes(ctx));
  v1.use(unknownEndpointGuard(ctx));
  // The OpenAPI document is open, like /healthz: it describes the API, nothing of its state.
  let openapi: Record<string, unknown> | undefined;
  app.get('/api/v1/openapi.json', (_req, res) => {
    res.json((openapi ??= openApiDocument(v1, VERSION)));
  });
  app.use('/api/v1', v1);
  app.get('/healthz', healthHandler(ctx));
  app.get('/metrics', metricsHandler(ctx));
  app.use(ADMIN_PATH, adminRoutes(ctx));
  app.get('/files/:token', fileDownloadHandler(ctx));
  app.use(notFoundHandler);
  app.use(errorHandler);

  const stopSweeper = startCheckpointSweeper(ctx, Math.min(30_000, listingSweepMs(config.retentionS)));
  const stopReaper = futures.startReaper();
  // Ops waiting behind a gap fail at its deadline even when nobody polls them.
  const gapTimer = setInterval(() => void gate.expireGaps().catch(() => undefined), Math.min(5_000, gate.gapTimeoutMs));
  gapTimer.unref();
  // Listing entries whose record expired leave within a quarter of the retention, at most a minute (queues/contract/names.ts).
  let pruning = false;
  const pruneTimer = setInterval(() => {
    if (pruning) return;
    pruning = true;
    pruneListings(redis, names)
      .catch((e) => logger.debug('listing sweep failed (Redis unreachable?)', { error: String(e) }))
      .finally(() => (pruning = false));
  }, listingSweepMs(config.retentionS));
  pruneTimer.unref();
  const close = async () => {
    clearInterval(gapTimer);
    clearInterval(pruneTimer);
    stopSweeper();
    stopReaper();
    await futures.close();
    await queues.close();
    await Promise.all(blocking.map((c) => c.quit().catch(() => undefined)));
    await redis.quit().catch(() => undefined);
  };
  const listener = direct.listener(app, (path) => [requestContext, redisCheck, ...v1Before(path)], errorHandler);
  return { app, listener, serverOptions: direct.serverOptions(app), ctx, close };
}
