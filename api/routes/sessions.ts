import { Router } from 'express';
import { tenantOf } from '../auth.js';
import type { ApiContext } from '../context.js';
import { CreateSessionBody, FinishSessionBody, PageQuery, parseBody, SessionHeartbeatBody, SessionSearchBody } from '../http-schemas.js';
import { createSession, finishSession, heartbeat, searchSessions } from '../services/sessions.js';
import { requireSession } from '../tenants.js';

/** Client sessions: create_session, heartbeats, and the REST side (list, members, finish, search) (api/services/sessions.ts). */
export function sessionRoutes(ctx: ApiContext): Router {
  const r = Router();

  r.post('/create_session', async (req, res) => {
    const body = parseBody(CreateSessionBody, req.body, 'create_session');
    const sessionId = await createSession(ctx, req, {
      tags: body.tags,
      user_metadata: body.user_metadata ?? {},
      sdk_version: body.sdk_version ?? null,
      project_id: body.project_id ?? null,
    });
    res.json({ type: 'create_session', session_id: sessionId });
  });

  r.post('/session_heartbeat', async (req, res) => {
    await heartbeat(ctx, req, parseBody(SessionHeartbeatBody, req.body, 'session_heartbeat').session_id);
    res.json({ type: 'session_heartbeat' });
  });

  r.get('/sessions', async (req, res) => {
    const page = parseBody(PageQuery(), req.query, 'sessions');
    res.json({ sessions: await ctx.registry.sessions.list(tenantOf(req), page.offset, page.limit) });
  });

  r.get('/sessions/:id', async (req, res) => {
    await requireSession(ctx, req, req.params.id);
    res.json(await ctx.registry.sessions.members(req.params.id));
  });

  // ServiceClient.close(): the first finish reason wins; later heartbeats get 410.
  r.post('/sessions/:id/finish', async (req, res) => {
    const body = parseBody(FinishSessionBody, req.body, 'finish session');
    res.json(await finishSession(ctx, req, req.params.id, body.reason, body.detail ?? null));
  });

  r.post('/sessions/search', async (req, res) => {
    const body = parseBody(SessionSearchBody, req.body, 'sessions/search');
    res.json({ sessions: await searchSessions(ctx, req, body), next_cursor: null });
  });

  // No trace recorder runs here: the export reports that, and the SDK raises it to the caller.
  r.get('/sessions/:id/trace_export', async (req, res) => {
    await requireSession(ctx, req, req.params.id);
    res.json({ status: 'failed', error: 'session trace export is not available on this server (tinker-broker records no traces)' });
  });

  r.put('/sessions/:id/project', async (req, res) => {
    await requireSession(ctx, req, req.params.id);
    res.json({});
  });

  return r;
}
