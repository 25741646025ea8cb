import { randomUUID } from 'node:crypto';
import type { Request } from 'express';
import { BrokerError } from '../../queues/contract/errors.js';
import { tenantOf } from '../auth.js';
import type { ApiContext } from '../context.js';
import { ensureRoom } from '../quotas.js';
import { requireSession, unknownSession } from '../tenants.js';

/**
 * Client sessions: creation, heartbeats (which keep them for the retention), the finish of
 * ServiceClient.close(), and the REST listings and search over them.
 */

/** A new session of the caller; returns its id. */
export async function createSession(
  ctx: ApiContext,
  req: Request,
  info: { tags: string[]; user_metadata?: Record<string, unknown>; sdk_version?: string | null; project_id?: string | null },
): Promise<string> {
  await ensureRoom(ctx, req, 'sessions');
  const sessionId = randomUUID();
  await ctx.registry.sessions.create(sessionId, tenantOf(req), info, ctx.config.retentionS);
  return sessionId;
}

/** Keeps a session for another retention period; a finished session answers GONE (410 stops the SDK's heartbeat loop). */
export async function heartbeat(ctx: ApiContext, req: Request, sessionId: string): Promise<void> {
  await requireSession(ctx, req, sessionId);
  if (!(await ctx.registry.sessions.touch(sessionId, ctx.config.retentionS))) throw unknownSession(sessionId);
  if (await ctx.registry.sessions.finished(sessionId)) throw new BrokerError('GONE', `session '${sessionId}' has finished`);
}

/** ServiceClient.close(): the first finish reason wins. */
export async function finishSession(ctx: ApiContext, req: Request, sessionId: string, reason: Record<string, unknown>, detail: string | null) {
  await requireSession(ctx, req, sessionId);
  return ctx.registry.sessions.finish(sessionId, { reason, detail, finished_at: new Date().toISOString() }, ctx.config.retentionS);
}

type SessionSearch = {
  session_id?: string | null | undefined;
  user_metadata: Record<string, string>;
  statuses?: { type: string }[] | null | undefined;
  limit: number;
};

/**
 * sessions/search: the caller's sessions (newest first) that match the id, every user_metadata
 * entry and one of the statuses, with their checkpoint counts. A fixed number of Redis round trips,
 * however many sessions the tenant has.
 */
export async function searchSessions(ctx: ApiContext, req: Request, q: SessionSearch) {
  const all = await ctx.registry.sessions.list(tenantOf(req), 0, 10_000);
  const ids = q.session_id ? all.filter((id) => id === q.session_id) : all;
  const [infos, finishes] = await Promise.all([ctx.registry.sessions.infos(ids), ctx.registry.sessions.finishes(ids)]);
  const statuses = q.statuses?.map((s) => s.type);
  const hits = ids
    .map((id, i) => ({ id, info: infos[i], finished: finishes[i] }))
    .filter(({ info, finished }) => {
      if (!info) return false;
      const meta = (info.user_metadata ?? {}) as Record<string, string>;
      if (Object.entries(q.user_metadata).some(([k, v]) => meta[k] !== v)) return false;
      return !statuses || statuses.includes(finished ? 'client_finished' : 'active');
    })
    .slice(0, q.limit);
  const counts = await ctx.registry.sessions.checkpointCounts(hits.map((h) => h.id));
  return hits.map(({ id, info, finished }, i) => ({
    session_id: id,
    created_at: String(info!.created_at),
    owner: 'local',
    project_id: String(info!.project_id ?? 'default'),
    status: finished ? { type: 'client_finished', reason: finished.reason, detail: finished.detail, finished_at: finished.finished_at } : { type: 'active' },
    checkpoints_count: counts[i] ?? 0,
    user_metadata: (info!.user_metadata ?? {}) as Record<string, string>,
  }));
}
