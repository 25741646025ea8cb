import { Router, type RequestHandler } from 'express';
import { LOSSES } from '../../queues/contract/losses.js';
import type { ApiContext } from '../context.js';

/** Client bootstrap, telemetry, billing, health and capabilities (sessions: routes/sessions.ts). */

/** get_server_capabilities' notes: where this server's losses differ from, or guess at, Tinker's (docs/losses.md). */
export const CAPABILITY_NOTES = [
  `losses: ${Object.keys(LOSSES).join(', ')}; definitions, defaults and sources in docs/losses.md`,
  "stable_reinforce: Tinker's exact objective is not public. This server implements REINFORCE with a truncated, detached importance weight " +
    "min(exp(lp - q), clip_high_threshold=4.0) against the sampler logprobs q it recorded for each sequence_id (record_stability_info), plus " +
    'kl_coeff * sum(r - 1 - log r) (k3 estimate of KL(sampler || model), default kl_coeff 0); the datum\'s own logprobs are not used',
  'gspo: GSPO-token as in Tinker\'s docs; default clip thresholds 1 - 3e-4 / 1 + 4e-4 (GSPO paper); without sequence_ratio_mask the ratio spans the tokens with a nonzero advantage',
  'cispo: default clip thresholds 0.0 / 4.0 (one-sided, as Tinker documents)',
  'optimizers: adamw only (dimuon refused)',
  'custom losses (create_custom_loss) run on the server in one forward_backward (torch engine; verl refuses them): the traced graph is rebuilt from an allowlist of torch, math and operator functions (queues/contract/custom-loss.json), inputs of rank 0 (per-datum scalar), 1 and 2; metrics: loss:sum and the loss\'s custom/* metrics (no surrogate_loss:sum)',
];
export function serviceRoutes(ctx: ApiContext): Router {
  const r = Router();

  // Feature flags for the SDK: its pyqwest (reqwest) transport, zstd-compressed protobuf
  // forward_backward bodies (api/wire/zstd.ts), and server-side custom losses (api/services/custom-loss.ts).
  r.post('/client/config', (_req, res) => {
    res.json({
      pjwt_auth_enabled: false,
      credential_default_source: 'api_key',
      use_pyqwest_transport: true,
      proto_compress_fwdbwd: true,
      parallel_fwdbwd_chunks: true,
      create_model_via_load_weights: false,
      sample_use_retrieve_futures: ctx.config.sampleRetrieveFutures === true,
      sample_join_sampling_session: true,
      custom_loss_server_side: true,
    });
  });

  r.post('/client/dynamic_config', (_req, res) => {
    res.json({ refresh_interval_sec: 300, sample_cancel_enabled: false });
  });

  r.post('/telemetry', (_req, res) => {
    res.json({ status: 'accepted' });
  });

  r.get('/get_server_capabilities', async (_req, res) => {
    const served = await ctx.registry.agents.servedModels();
    res.json({
      // What the agents serving each model say their engines do (their records' capabilities).
      supported_models: [...served.values()].map(({ model, samplers }) => ({
        model_name: model.name,
        max_context_length: model.max_context_length,
        trainable: model.trainable,
        sampleable: samplers.length > 0,
      })),
      // Not in the SDK's response type (it keeps unknown fields): what a user should know about the losses.
      notes: CAPABILITY_NOTES,
    });
  });

  // Nothing is billed on your own hardware: no usage events (storage in use: routes/checkpoints.ts).
  r.get('/billing/usage/events', (_req, res) => {
    res.json({ data: [], sessions: {} });
  });

  r.get('/healthz', healthHandler(ctx));

  return r;
}

/**
 * Ready once live agents (heartbeat within 2.5 beats) serve every required model (any agent when none is configured). Open
 * without a key, so it names no model (canonical names are absolute paths on the server): only counts.
 */
export function healthHandler(ctx: ApiContext): RequestHandler {
  return async (_req, res) => {
    if (ctx.localAgentsReady && !ctx.localAgentsReady()) {
      res.status(503).json({ status: 'starting', detail: 'the worker agents of this node are starting' });
      return;
    }
    // Only agents that beat lately: a killed node's liveness key outlives it (queues/registry/agents.ts liveAged).
    const served = await ctx.registry.agents.servedModels(true);
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
