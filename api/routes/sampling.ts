import { Router } from 'express';
import type { ApiContext } from '../context.js';
import type { DirectRoutes } from '../direct.js';
import { CreateSamplingSessionBody, JoinSamplingSessionBody, parseBody, SampleBody } from '../http-schemas.js';
import { createSamplingSession, sample } from '../services/sampling.js';
import { requireSamplingSession } from '../tenants.js';

/** Sampling sessions and asample (api/services/sampling.ts). */
export function samplingRoutes(ctx: ApiContext, direct: DirectRoutes): Router {
  const r = Router();

  r.post('/create_sampling_session', async (req, res) => {
    const body = parseBody(CreateSamplingSessionBody, req.body, 'create_sampling_session');
    res.json({ type: 'create_sampling_session', sampling_session_id: await createSamplingSession(ctx, req, body) });
  });

  // An unpickled SamplingClient asks for its clone number; its seq_ids then start at 1e9·n.
  r.post('/join_sampling_session', async (req, res) => {
    const body = parseBody(JoinSamplingSessionBody, req.body, 'join_sampling_session');
    await requireSamplingSession(ctx, req, body.sampling_session_id);
    const n = await ctx.redis.incr(`${ctx.names.samplingSession(body.sampling_session_id)}:clones`);
    res.json({ type: 'join_sampling_session', client_counter: n });
  });

  r.get('/samplers/:id', async (req, res) => {
    const s = await requireSamplingSession(ctx, req, req.params.id);
    res.json({ sampler_id: s.sampling_session_id, base_model: s.base_model, model_path: s.model_path });
  });

  direct.post(r, '/asample', async (req, res) => {
    res.json(await sample(ctx, req, parseBody(SampleBody, req.body, 'asample')));
  });

  return r;
}
