import { expect } from 'chai';
import type { Router } from 'express';
import { buildApp } from '../api/app.js';
import { openApiDocument, OPERATIONS, routesOf } from '../api/openapi.js';
import { loadApiConfig } from '../queues/infra/config.js';

/**
 * The OpenAPI document (GET /api/v1/openapi.json) lists every route the API mounts, each with a
 * summary in api/openapi.ts OPERATIONS, and request bodies from the zod schemas.
 */
describe('OpenAPI document', () => {
  const built = buildApp(loadApiConfig({ TB_PREFIX: 'openapi-test' }));
  after(() => built.close());
  // The router mounted at /api/v1: the one that holds create_model.
  const v1 = ((built.app as unknown as { router: { stack: { handle: Router & { stack?: unknown[] } }[] } }).router.stack.map((l) => l.handle).find(
    (h) => h.stack && routesOf(h).includes('POST /create_model'),
  ))!;
  const doc = openApiDocument(v1, '0.0.0') as { openapi: string; paths: Record<string, Record<string, any>>; components: any };

  it('documents every mounted route (a new route needs an entry in OPERATIONS, api/openapi.ts)', () => {
    const routes = routesOf(v1);
    expect(routes.length).to.be.greaterThan(35);
    const undocumented = routes.filter((r) => !OPERATIONS[r]);
    expect(undocumented, 'add these to OPERATIONS in api/openapi.ts').to.deep.equal([]);
    const stale = Object.keys(OPERATIONS).filter((k) => !routes.includes(k));
    expect(stale, 'OPERATIONS names routes that no longer exist').to.deep.equal([]);
    const ops = Object.entries(doc.paths).flatMap(([p, m]) => Object.keys(m).map((k) => `${k.toUpperCase()} ${p}`));
    expect(ops.sort()).to.deep.equal([...routes].sort());
  });

  it('takes request bodies from the zod schemas', () => {
    expect(doc.openapi).to.equal('3.1.0');
    const create = doc.paths['/create_model']!.post.requestBody.content['application/json'].schema;
    expect(create).to.not.have.property('$schema');
    expect(create.required).to.include.members(['session_id', 'base_model', 'model_seq_id']);
    expect(create.properties.lora_config.anyOf[0].properties.rank).to.include({ type: 'integer', maximum: 1024 });
    // Fields with defaults are optional for a client.
    const sample = doc.paths['/asample']!.post.requestBody.content['application/json'].schema;
    expect(sample.required).to.include('sampling_params').and.not.include('num_samples');
    expect(sample.properties.num_samples).to.include({ type: 'integer', default: 1, maximum: 1024 });
    expect(doc.paths['/forward_backward']!.post.requestBody.content).to.have.key('application/x-protobuf');
    expect(doc.paths['/training_runs/{id}/checkpoints']!.get.parameters[0]).to.include({ name: 'id', in: 'path', required: true });
    expect(doc.paths['/training_runs']!.get.parameters.map((p: { name: string }) => p.name)).to.deep.equal(['limit', 'offset']);
    expect(doc.paths['/healthz']!.get.security).to.deep.equal([]);
    expect(doc.components.securitySchemes.apiKey).to.include({ in: 'header', name: 'X-API-Key' });
    expect(doc.paths['/create_model']!.post.responses['200'].content['application/json'].schema.$ref).to.equal('#/components/schemas/Future');
  });
});
