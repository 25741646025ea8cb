import { randomUUID } from 'node:crypto';
import { Router, type RequestHandler } from 'express';
import { BrokerError } from '../../queues/errors.js';
import { tenantOf } from '../auth.js';
import type { ApiContext } from '../context.js';
import { requireSession } from '../tenants.js';
import { CreateSessionBody, parseBody, SessionHeartbeatBody } from '../http-schemas.js';

/** Client bootstrap, sessions, telemetry, health and capabilities. */
export function serviceRoutes(ctx: ApiContext): Router {
  const r = Router();

  // Feature flags for the SDK: plain httpx transport, uncompressed protobuf forward_backward,
  // and none of the optional server-side features.
  r.post('/client/config', (_req, res) => {
    res.json({
      pjwt_auth_enabled: false,
      credential_default_source: 'api_key',
      use_pyqwest_transport: false,
      proto_compress_fwdbwd: false,
      parallel_fwdbwd_chunks: true,
      create_model_via_load_weights: false,
      sample_use_retrieve_futures: false,
      sample_join_sampling_session: true,
      custom_loss_server_side: false,
    });
  });

  r.post('/client/dynamic_config', (_req, res) => {
    res.json({ refresh_interval_sec: 300, sample_cancel_enabled: false });
  });

  r.post('/create_session', async (req, res) => {
    const body = parseBody(CreateSessionBody, req.body, 'create_session');
    const sessionId = randomUUID();
    await ctx.registry.createSession(
      sessionId,
      tenantOf(req),
      { tags: body.tags, user_metadata: body.user_metadata ?? {}, sdk_version: body.sdk_version ?? null, project_id: body.project_id ?? null },
      ctx.config.retentionS,
    );
    res.json({ type: 'create_session', session_id: sessionId });
  });

  r.post('/session_heartbeat', async (req, res) => {
    const body = parseBody(SessionHeartbeatBody, req.body, 'session_heartbeat');
    await requireSession(ctx, req, body.session_id);
    if (!(await ctx.registry.touchSession(body.session_id, ctx.config.retentionS)))
      throw new BrokerError('NOT_FOUND', `unknown session '${body.session_id}'`);
    // A finished session (ServiceClient.close) answers 410, which stops the SDK's heartbeat loop.
    if (await ctx.registry.sessionFinished(body.session_id)) throw new BrokerError('GONE', `session '${body.session_id}' has finished`);
    res.json({ type: 'session_heartbeat' });
  });

  r.post('/telemetry', (_req, res) => {
    res.json({ status: 'accepted' });
  });

  r.get('/get_server_capabilities', async (_req, res) => {
    const served = await ctx.registry.servedModels();
    res.json({
      supported_models: [...served.values()].map(({ model }) => ({
        model_name: model.name,
        max_context_length: model.max_context_length,
        trainable: model.trainable,
        sampleable: true,
      })),
    });
  });

  r.get('/healthz', healthHandler(ctx));

  return r;
}

/**
 * Ready once live agents serve every required model (any agent when none is configured). Open
 * without a key, so it names no model (canonical names are absolute paths on the server): only counts.
 */
export function healthHandler(ctx: ApiContext): RequestHandler {
  return async (_req, res) => {
    const served = await ctx.registry.servedModels();
    const names = new Set<string>();
    for (const { model } of served.values()) [model.name, ...model.aliases].forEach((n) => names.add(n));
    const missing = ctx.config.requiredModels.filter((m) => !names.has(m));
    if (served.size > 0 && missing.length === 0) {
      res.json({ status: 'ready', models: served.size });
    } else {
      res.status(503).json({
        status: 'starting',
        detail: served.size === 0 ? 'no worker agent is serving a model yet' : `waiting for agents serving ${missing.length} required model(s)`,
      });
    }
  };
}
