import { createHash, timingSafeEqual } from 'node:crypto';
import { createBullBoard } from '@bull-board/api';
import { BullMQAdapter } from '@bull-board/api/bullMQAdapter';
import { ExpressAdapter } from '@bull-board/express';
import { Router, type RequestHandler } from 'express';
import { queueNames } from '../queues/runtime/inspect.js';
import type { ApiConfig } from '../queues/infra/config.js';
import type { ApiContext } from './context.js';

/**
 * The queue dashboard (bull-board) under `/admin`: every training and sample queue of the
 * deployment, its jobs, their data, results, errors and timings. Read-only: a training op run
 * twice would double a gradient, so retrying, promoting or deleting jobs is not offered.
 *
 * A browser cannot add an `X-API-Key` header, so the dashboard takes HTTP basic auth: any user
 * name, an admin key as the password (the browser asks once). `X-API-Key` works too (scripts).
 * The dashboard shows every tenant's jobs, so its keys are `TB_ADMIN_KEYS`; without them, the API
 * key when exactly one is configured (a single-tenant install), else the dashboard stays closed.
 */
export const ADMIN_PATH = '/admin';

/** How long the list of queues is reused before the next page load looks again. */
const REFRESH_MS = 5_000;

const digest = (s: string) => createHash('sha256').update(s, 'utf8').digest();

/** The keys that open the dashboard (see above). */
export function adminKeys(config: Pick<ApiConfig, 'apiKeys' | 'adminKeys'>): string[] {
  if (config.adminKeys?.length) return config.adminKeys;
  return config.apiKeys.length === 1 ? [...config.apiKeys] : [];
}

export function adminAuth(keys: readonly string[]): RequestHandler {
  const allowed = keys.map(digest);
  return (req, res, next) => {
    if (allowed.length === 0) {
      res.status(403).type('text/plain').send('the dashboard shows every API key\'s jobs: set TB_ADMIN_KEYS to open it\n');
      return;
    }
    const header = req.header('x-api-key');
    let key = header ?? null;
    const basic = /^Basic\s+(.+)$/i.exec(req.header('authorization') ?? '');
    if (!key && basic) {
      const decoded = Buffer.from(basic[1]!, 'base64').toString('utf8');
      key = decoded.slice(decoded.indexOf(':') + 1);
    }
    if (key !== null) {
      const d = digest(key);
      // Constant time over every configured key.
      let ok = false;
      for (const a of allowed) ok = timingSafeEqual(a, d) || ok;
      if (ok) return next();
    }
    res
      .status(401)
      .set('www-authenticate', 'Basic realm="tinker-broker admin: any user name, an admin key as the password", charset="UTF-8"')
      .type('text/plain')
      .send(key === null ? 'log in with any user name and an admin key (TB_ADMIN_KEYS, or the API key of a single-key install) as the password\n' : 'invalid admin key\n');
  };
}

export function adminRoutes(ctx: ApiContext): Router {
  const server = new ExpressAdapter();
  server.setBasePath(ADMIN_PATH);
  const board = createBullBoard({ queues: [], serverAdapter: server, options: { uiConfig: { boardTitle: `tinker-broker (${ctx.config.prefix})` } } });
  const adapters = new Map<string, BullMQAdapter>();
  let listedAt = 0;
  let listing: Promise<void> | null = null;

  const refresh = async () => {
    const list = await queueNames(ctx.redis, ctx.names);
    for (const name of list)
      if (!adapters.has(name))
        adapters.set(
          name,
          new BullMQAdapter(ctx.queues.get(name), {
            readOnlyMode: true,
            allowRetries: false,
            description: name.startsWith('train-') ? `training ops of agent ${name.slice(6)}, in seq_id order` : 'sample jobs of one base model for one engine kind (the API routes each job to the fastest engine serving it)',
          }),
        );
    board.replaceQueues(list.map((n) => adapters.get(n)!));
    listedAt = Date.now();
  };

  const r = Router();
  r.use(adminAuth(adminKeys(ctx.config)));
  r.use(async (_req, _res, next) => {
    try {
      if (Date.now() - listedAt > REFRESH_MS) await (listing ??= refresh().finally(() => (listing = null)));
      next();
    } catch (e) {
      next(e);
    }
  });
  r.use(server.getRouter());
  return r;
}
