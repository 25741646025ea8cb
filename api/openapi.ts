import type { Router } from 'express';
import { z } from 'zod';
import * as S from './http-schemas.js';

/**
 * The OpenAPI 3.1 document of the HTTP API, served at `GET /api/v1/openapi.json`. The list of
 * operations is read from the mounted routers, so no route is missing; request bodies come from
 * the zod schemas in http-schemas.ts (`z.toJSONSchema`), with the summaries below.
 */

type Doc = { summary: string; body?: z.ZodType; query?: z.ZodType; protobuf?: string; future?: boolean; tag: string };

const Paging = S.PageQuery();

/** Keyed by `METHOD /path` as the routers declare them; a tag names the route file (`api/routes/<tag>.ts`). */
export const OPERATIONS: Record<string, Doc> = {
  'POST /client/config': { tag: 'service', summary: 'Feature flags for the SDK' },
  'POST /client/dynamic_config': { tag: 'service', summary: 'Refresh interval and runtime flags for the SDK' },
  'POST /create_session': { tag: 'sessions', summary: 'Start a client session', body: S.CreateSessionBody },
  'POST /session_heartbeat': { tag: 'sessions', summary: "Keep a session alive (410 once it has finished)", body: S.SessionHeartbeatBody },
  'POST /telemetry': { tag: 'service', summary: 'Accepted and dropped' },
  'GET /get_server_capabilities': { tag: 'service', summary: 'Base models served by live agents, and whether each is trainable' },
  'GET /healthz': { tag: 'service', summary: 'ready (200) once agents serve the required models, else starting (503); no API key needed' },
  'POST /create_model': { tag: 'models', summary: 'Create a LoRA training model on a base model', body: S.CreateModelBody, future: true },
  'POST /get_info': { tag: 'models', summary: 'A training model: base model, LoRA rank, tokenizer id', body: S.ModelIdBody },
  'POST /forward_backward': {
    tag: 'training',
    summary: 'Forward and backward pass over a batch (forward only when forward_only is set); ordered by seq_id per model',
    protobuf: 'tinker.ForwardBackwardRequest (api/wire/tinker_public.proto)',
    future: true,
  },
  'POST /optim_step': { tag: 'training', summary: 'Adam step on the accumulated gradients', body: S.OptimStepBody, future: true },
  'POST /save_weights_for_sampler': { tag: 'training', summary: 'Save a sampler version (named, or for a sampling session)', body: S.SaveWeightsForSamplerBody, future: true },
  'POST /save_weights': { tag: 'training', summary: 'Save the training state (adapter and optimizer)', body: S.SaveWeightsBody, future: true },
  'POST /load_weights': {
    tag: 'training',
    summary: 'Load a training checkpoint into a model; without model_id, create a model from it (CreateViaLoadBody)',
    body: S.LoadWeightsBody,
    future: true,
  },
  'POST /save_weights_external': { tag: 'training', summary: 'Save the adapter as files for download (optionally age-encrypted)', body: S.SaveWeightsExternalBody, future: true },
  'POST /unload_model': { tag: 'models', summary: "Free a model's weights on its agent", body: S.ModelIdBody, future: true },
  'POST /create_custom_loss': { tag: 'custom-loss', summary: 'Store a traced custom loss (checked against the allowlist) for forward_backward with loss_fn custom', body: S.CreateCustomLossBody, future: true },
  'POST /create_sampling_session': { tag: 'sampling', summary: 'A sampling session on a base model or a sampler version', body: S.CreateSamplingSessionBody },
  'POST /join_sampling_session': { tag: 'sampling', summary: 'Join an existing sampling session', body: S.JoinSamplingSessionBody },
  'GET /samplers/{id}': { tag: 'sampling', summary: 'A sampling session: base model and sampler version' },
  'POST /asample': { tag: 'sampling', summary: 'Sample completions (and prompt logprobs)', body: S.SampleBody, future: true },
  'POST /retrieve_future': {
    tag: 'futures',
    summary: "An operation's result; held open up to the long-poll window, then {type: try_again}",
    body: S.RetrieveFutureBody,
  },
  'POST /retrieve_futures': {
    tag: 'session-futures',
    summary: "The samples of a sampling session's client that ended since its cursor (the SDK's session poller); held open up to the long-poll window",
    body: S.RetrieveFuturesBody,
  },
  'GET /training_runs': { tag: 'models', summary: 'Training runs (models), newest first', query: Paging },
  'GET /training_runs/{id}': { tag: 'models', summary: 'One training run' },
  'GET /training_runs/{id}/checkpoints': { tag: 'checkpoints', summary: "A training run's checkpoints" },
  'DELETE /training_runs/{id}/checkpoints/{kind}/{name}': { tag: 'checkpoints', summary: 'Delete a checkpoint and its files' },
  'POST /training_runs/{id}/checkpoints/{kind}/{name}/publish': { tag: 'checkpoints', summary: 'Make a checkpoint public' },
  'DELETE /training_runs/{id}/checkpoints/{kind}/{name}/publish': { tag: 'checkpoints', summary: 'Make a checkpoint private again' },
  'PUT /training_runs/{id}/checkpoints/{kind}/{name}/ttl': { tag: 'checkpoints', summary: "Set or clear a checkpoint's time to live", body: S.CheckpointTtlBody },
  'GET /training_runs/{id}/checkpoints/{kind}/{name}/external_weights_urls': { tag: 'checkpoints', summary: 'Signed download URLs of external weights' },
  'POST /copy_weights': { tag: 'checkpoints', summary: 'Copy a checkpoint under a new training run', body: S.CopyWeightsBody },
  'GET /checkpoints': { tag: 'checkpoints', summary: 'Every listed checkpoint, newest first', query: S.PageQuery(100) },
  'POST /weights_info': { tag: 'checkpoints', summary: 'Base model and LoRA settings of a tinker:// path', body: S.WeightsInfoBody },
  'GET /sessions': { tag: 'sessions', summary: 'Sessions, newest first', query: Paging },
  'GET /sessions/{id}': { tag: 'sessions', summary: 'One session: its training runs and samplers' },
  'POST /sessions/{id}/finish': { tag: 'sessions', summary: 'Mark a session finished', body: S.FinishSessionBody },
  'POST /sessions/search': { tag: 'sessions', summary: 'Find sessions by id or user metadata', body: S.SessionSearchBody },
  'GET /sessions/{id}/trace_export': { tag: 'sessions', summary: 'Trace export (empty here)' },
  'GET /audit': { tag: 'checkpoints', summary: 'Audit events (empty here)' },
  'GET /billing/usage/events': { tag: 'service', summary: 'Billing events (empty here)' },
  'GET /billing/usage/checkpoints/current': { tag: 'checkpoints', summary: 'Checkpoint storage in use' },
  'PUT /sessions/{id}/project': { tag: 'sessions', summary: "Set a session's project" },
};

type Layer = { route?: { path: string | string[]; methods: Record<string, boolean> }; handle?: { stack?: Layer[] } };

/** `METHOD /path` of every route of a router and the routers mounted in it (paths relative to its mount point). */
export function routesOf(router: Router): string[] {
  const out: string[] = [];
  const walk = (stack: Layer[]) => {
    for (const l of stack) {
      if (l.route) {
        for (const p of Array.isArray(l.route.path) ? l.route.path : [l.route.path])
          for (const [m, on] of Object.entries(l.route.methods)) if (on && m !== '_all') out.push(`${m.toUpperCase()} ${p.replace(/:([A-Za-z_]+)/g, '{$1}')}`);
      } else if (l.handle?.stack) walk(l.handle.stack);
    }
  };
  walk((router as unknown as { stack: Layer[] }).stack);
  return [...new Set(out)];
}

/** A request schema as JSON Schema (what a client may send: defaults are optional), without `$schema` (OpenAPI 3.1 implies it). */
const json = (schema: z.ZodType) => {
  const { $schema: _, ...rest } = z.toJSONSchema(schema, { io: 'input', unrepresentable: 'any', target: 'draft-2020-12' }) as Record<string, unknown>;
  return rest;
};

export function openApiDocument(v1: Router, version: string): Record<string, unknown> {
  const paths: Record<string, Record<string, unknown>> = {};
  for (const key of routesOf(v1).sort((a, b) => a.split(' ')[1]!.localeCompare(b.split(' ')[1]!))) {
    const [method, p] = key.split(' ') as [string, string];
    const doc = OPERATIONS[key];
    const params = [...p.matchAll(/\{([A-Za-z_]+)\}/g)].map((m) => ({ name: m[1], in: 'path', required: true, schema: { type: 'string' } }));
    if (doc?.query) {
      const q = json(doc.query) as { properties?: Record<string, unknown>; required?: string[] };
      for (const [name, schema] of Object.entries(q.properties ?? {})) params.push({ name, in: 'query', required: q.required?.includes(name) ?? false, schema } as never);
    }
    const op: Record<string, unknown> = {
      operationId: `${method.toLowerCase()}${p.replace(/[{}]/g, '').replace(/[^A-Za-z0-9]+(.)?/g, (_, c: string | undefined) => (c ? c.toUpperCase() : ''))}`,
      summary: doc?.summary ?? '(undocumented)',
      tags: [doc?.tag ?? 'other'],
      ...(params.length ? { parameters: params } : {}),
      responses: {
        '200': {
          description: doc?.future ? 'A future: poll it with POST /retrieve_future' : 'OK',
          content: { 'application/json': { schema: doc?.future ? { $ref: '#/components/schemas/Future' } : { type: 'object' } } },
        },
        default: { description: 'An error in the Tinker shape', content: { 'application/json': { schema: { $ref: '#/components/schemas/Error' } } } },
      },
      ...(p === '/healthz' ? { security: [] } : {}),
    };
    if (doc?.body) op.requestBody = { required: true, content: { 'application/json': { schema: json(doc.body) } } };
    if (doc?.protobuf)
      op.requestBody = { required: true, description: `protobuf ${doc.protobuf}`, content: { 'application/x-protobuf': { schema: { type: 'string', format: 'binary' } } } };
    (paths[p] ??= {})[method.toLowerCase()] = op;
  }
  return {
    openapi: '3.1.0',
    info: {
      title: 'tinker-broker',
      version,
      description: 'The Tinker HTTP API as served by tinker-broker (the Tinker Python SDK 0.38 speaks it). Operations that run on an engine return a future.',
    },
    servers: [{ url: '/api/v1' }],
    security: [{ apiKey: [] }],
    components: {
      securitySchemes: { apiKey: { type: 'apiKey', in: 'header', name: 'X-API-Key' } },
      schemas: {
        Future: { type: 'object', required: ['request_id'], properties: { request_id: { type: 'string' }, model_id: { type: 'string' } } },
        Error: {
          type: 'object',
          required: ['error', 'category'],
          properties: { error: { type: 'string' }, category: { enum: ['user', 'server'] }, code: { type: 'string', description: 'INVALID_REQUEST, UNAUTHORIZED, NOT_FOUND, …' } },
        },
      },
    },
    paths,
  };
}
