import { expect } from 'chai';
import { TINY_MODEL_ALIAS } from '../../scripts/stack.js';
import { waitFor } from './procs.js';
import { call, type HttpReply } from './stack.js';
import { decodeForwardBackwardOutput, encodeForwardBackward, type TestDatum } from './wire.js';

export const PROTO = 'application/x-protobuf';
export const BATCH: TestDatum[] = [
  { tokens: [5, 17, 42, 99, 7], targets: [17, 42, 99, 7, 300], weights: [1, 1, 1, 1, 1] },
  { tokens: [11, 12, 13], targets: [12, 13, 14], weights: [0, 1, 1] },
];

/** A Tinker client over bare HTTP (the test key), for tests that kill and restart processes under it. */
export class Client {
  session = '';
  private modelSeq = 0;
  private readonly seqs = new Map<string, number>();
  constructor(readonly api: { baseUrl: string }) {}

  async init(): Promise<void> {
    this.session = (await call(this.api.baseUrl, 'POST', '/create_session', { tags: [] })).json.session_id;
  }
  /** Polls until the future is answered (a Redis outage or try_again: again). */
  async result(requestId: string, accept = 'application/json', timeoutMs = 90_000): Promise<HttpReply> {
    return waitFor(`future ${requestId}`, async () => {
      const r = await call(this.api.baseUrl, 'POST', '/retrieve_future', { request_id: requestId }, { accept });
      if (r.status >= 500 || r.json?.type === 'try_again') return null;
      return r;
    }, timeoutMs, 50);
  }
  async createModel(seed = 0, rank = 4): Promise<string> {
    const r = await call(this.api.baseUrl, 'POST', '/create_model', { session_id: this.session, model_seq_id: this.modelSeq++, base_model: TINY_MODEL_ALIAS, lora_config: { rank, seed } });
    expect(r.status, JSON.stringify(r.json)).to.equal(200);
    const done = await this.result(r.json.request_id);
    expect(done.json.model_id, JSON.stringify(done.json)).to.be.a('string');
    this.seqs.set(done.json.model_id, 1);
    return done.json.model_id;
  }
  private seq(model: string): number {
    const s = this.seqs.get(model)!;
    this.seqs.set(model, s + 1);
    return s;
  }
  async submitFb(model: string, data: TestDatum[] = BATCH, lossFn = 'cross_entropy'): Promise<string> {
    const r = await call(this.api.baseUrl, 'POST', '/forward_backward', undefined, { raw: encodeForwardBackward({ modelId: model, seqId: this.seq(model), data, lossFn }) });
    expect(r.status, JSON.stringify(r.json)).to.equal(200);
    return r.json.request_id;
  }
  async submitOptim(model: string, lr = 0.05): Promise<string> {
    const r = await call(this.api.baseUrl, 'POST', '/optim_step', { model_id: model, seq_id: this.seq(model), adam_params: { learning_rate: lr, beta1: 0.9, beta2: 0.95, eps: 1e-12, weight_decay: 0, grad_clip_norm: 0 } });
    expect(r.status, JSON.stringify(r.json)).to.equal(200);
    return r.json.request_id;
  }
  /** save_weights_for_sampler under `path`: the sampler version's tinker path. */
  async saveSampler(model: string, path: string): Promise<string> {
    const r = await call(this.api.baseUrl, 'POST', '/save_weights_for_sampler', { model_id: model, seq_id: this.seq(model), path });
    expect(r.status, JSON.stringify(r.json)).to.equal(200);
    return (await this.result(r.json.request_id)).json.path;
  }
  /** The summed loss of a finished forward_backward (throws with the reply when it failed). */
  async loss(requestId: string): Promise<number> {
    const r = await this.result(requestId, PROTO);
    if (!(r.headers.get('content-type') ?? '').includes(PROTO)) throw new Error(`forward_backward failed: ${JSON.stringify(r.json)}`);
    return decodeForwardBackwardOutput(r.body).metrics['loss:sum']!;
  }
  async optim(model: string): Promise<void> {
    const r = await this.result(await this.submitOptim(model));
    expect(r.json.type, JSON.stringify(r.json)).to.equal('optim_step');
  }
  /** fb + optim_step, `steps` times: the losses. */
  async train(model: string, steps: number): Promise<number[]> {
    const out: number[] = [];
    for (let i = 0; i < steps; i++) {
      out.push(await this.loss(await this.submitFb(model)));
      await this.optim(model);
    }
    return out;
  }
}

export function expectUnknownOutcome(r: HttpReply, why: RegExp): void {
  expect(r.json, JSON.stringify(r.json)).to.include({ category: 'unknown', code: 'OUTCOME_UNKNOWN' });
  expect(r.json.error).to.match(/^OUTCOME_UNKNOWN: the outcome of this .* is unknown/);
  expect(r.json.error).to.match(/load the model from a saved checkpoint/);
  expect(r.json.error).to.match(why);
}

