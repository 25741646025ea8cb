import { Router } from 'express';
import type { ApiContext } from '../context.js';
import type { DirectRoutes } from '../direct.js';
import { parseBody, RetrieveFuturesBody } from '../http-schemas.js';
import { tenantOf } from '../auth.js';
import { requireSamplingSession } from '../tenants.js';

/**
 * retrieve_futures: the SDK's session poller (`sample_use_retrieve_futures`), a long-poll on the
 * samples of one client of a sampling session that ended (api/futures.ts `sessionFutures`). It
 * answers `{completions: [{state: 'finished', request_id} | {state: 'failed', request_id, error,
 * category, code}], cursor}`; the client then fetches each result with retrieve_future. A poll with
 * nothing to report also reports the client's samples that ended without their entry (reconcile).
 */
export function sessionFutureRoutes(ctx: ApiContext, direct: DirectRoutes): Router {
  const r = Router();

  direct.post(r, '/retrieve_futures', async (req, res) => {
    const body = parseBody(RetrieveFuturesBody, req.body, 'retrieve_futures');
    const { sampling_session_id: id, cloned_sampler_id: clone } = body.target;
    // The tenant guard, before the acknowledgement changes anything: another tenant's session is
    // unknown (404), as one that never existed.
    await requireSamplingSession(ctx, req, id);
    const timeoutMs = body.timeout == null ? ctx.config.longPollMs : Math.min(ctx.config.longPollMs, Math.round(body.timeout * 1000));
    const abort = new AbortController();
    res.on('close', () => abort.abort());
    const out = await ctx.futures.sessionFutures(id, clone, body.prev_cursor, timeoutMs, tenantOf(req), abort.signal);
    if (abort.signal.aborted && !res.writable) return;
    res.json(out);
  });

  return r;
}
