import { Router } from 'express';
import type { ApiContext } from '../context.js';
import { CreateCustomLossBody, parseBody } from '../http-schemas.js';
import { createCustomLoss } from '../services/custom-loss.js';

/** create_custom_loss: a traced loss graph checked against the allowlist and stored for its session (api/services/custom-loss.ts). */
export function customLossRoutes(ctx: ApiContext): Router {
  const r = Router();
  r.post('/create_custom_loss', async (req, res) => {
    const body = parseBody(CreateCustomLossBody, req.body, 'create_custom_loss');
    res.json({ request_id: await createCustomLoss(ctx, req, body) });
  });
  return r;
}
