import { expect } from 'chai';
import { readFileSync } from 'node:fs';
import { protocolJsonText, PROTOCOL_JSON } from '../scripts/engine-protocol.js';
import { logger } from '../queues/infra/logger.js';
import { defaultPython, ensureTinyModel, TINY_MODEL_DIR } from '../scripts/stack.js';
import { EngineError, EngineProcess } from '../workers/engine.js';
import { decodeFrame, encodeFrame, FrameError } from '../workers/engine-frame.js';
import { BinTensor, ENGINE_OPS, PROTOCOL_VERSION } from '../workers/engine-protocol.js';

const log = logger.child({ test: 'engine-protocol' });

describe('engine protocol (the agent ⇄ engine contract)', () => {
  it('the Python engines read the same schemas (protocol.json is generated from workers/engine-protocol.ts)', () => {
    const committed = readFileSync(PROTOCOL_JSON, 'utf8');
    expect(committed === protocolJsonText(), 'workers/python/tinker_engine/protocol.json is stale: run `npm run engine-protocol`').to.equal(true);
    const parsed = JSON.parse(committed) as { protocol: number; ops: Record<string, unknown> };
    expect(parsed.protocol).to.equal(PROTOCOL_VERSION);
    expect(Object.keys(parsed.ops)).to.deep.equal(Object.keys(ENGINE_OPS));
  });

  it('frames carry tensors as aligned binary after the JSON, and decode to Tinker tensors', () => {
    const msg = {
      id: 7,
      args: {
        a: BinTensor.from({ dtype: 'float32', shape: [3], data: [0.5, -1.25e-7, 3] }),
        ids: BinTensor.from({ dtype: 'int64', shape: [2], data: [5, 2 ** 40] }),
        small: BinTensor.ints([2, 1], [1, -2]),
        n: 1.5,
      },
    };
    const frame = encodeFrame(msg);
    expect(frame.readUInt32BE(0)).to.equal(frame.length - 4);
    const j = frame.readUInt32BE(4);
    expect((4 + j) % 8, 'the JSON is space-padded: tensor bytes start 8-aligned in the body').to.equal(0);
    const head = JSON.parse(frame.toString('utf8', 8, 8 + j)) as { args: Record<string, unknown> };
    // No number lists in the JSON; each tensor at a multiple of 8; ids that fit travel as int32.
    expect(head.args.a).to.deep.equal({ dtype: 'float32', shape: [3], bin: [0, 12] });
    expect(head.args.ids).to.deep.equal({ dtype: 'int64', shape: [2], bin: [16, 16] });
    expect(head.args.small).to.deep.equal({ dtype: 'int32', shape: [2, 1], bin: [32, 8] });
    expect(frame.length - 8 - j).to.equal(40);
    const back = decodeFrame(frame.subarray(4)) as { args: Record<string, unknown> };
    expect(back.args.a).to.deep.equal({ dtype: 'float32', shape: [3], data: [0.5, Math.fround(-1.25e-7), 3] });
    expect(back.args.ids).to.deep.equal({ dtype: 'int64', shape: [2], data: [5, 2 ** 40] });
    expect(back.args.small).to.deep.equal({ dtype: 'int64', shape: [2, 1], data: [1, -2] });
    expect(back.args.n).to.equal(1.5);
  });

  it('a sample_batch result that is invalid for one request fails that request alone', () => {
    const seq = { tokens: [5, 6], logprobs: [-0.5, -1], stop_reason: 'length' };
    const good = { sequences: [seq], prompt_logprobs: null, topk_prompt_logprobs: null };
    const bad = { ...good, sequences: [{ ...seq, logprobs: [-0.5, null] }] }; // a NaN, sent as null
    const r = ENGINE_OPS.sample_batch.result.parse({ results: [{ ok: true, result: bad }, { ok: true, result: good }] });
    expect(r.results[0]).to.deep.include({ ok: false });
    expect(r.results[0]!.ok === false && r.results[0]!.error.message).to.match(/invalid sample result.*sequences\.0\.logprobs\.1/);
    expect(r.results[1]).to.deep.equal({ ok: true, result: good });
  });

  it('refuses hostile tensor references instead of reading outside the frame', () => {
    const frame = (ref: unknown, blob = Buffer.alloc(8)): Buffer => {
      const json = Buffer.from(JSON.stringify({ id: 1, t: ref }));
      const head = Buffer.alloc(4);
      head.writeUInt32BE(json.length);
      return Buffer.concat([head, json, blob]);
    };
    expect(() => decodeFrame(frame({ dtype: 'float32', shape: [4], bin: [0, 16] }))).to.throw(FrameError, /outside the frame/);
    expect(() => decodeFrame(frame({ dtype: 'float32', shape: [3], bin: [0, 8] }))).to.throw(FrameError, /needs 12 bytes/);
    expect(() => decodeFrame(frame({ dtype: 'float64', shape: [1], bin: [0, 8] }))).to.throw(FrameError, /unknown tensor dtype/);
    expect(() => decodeFrame(frame({ dtype: 'int32', shape: [-2], bin: [0, 8] }))).to.throw(FrameError);
    expect(() => decodeFrame(Buffer.from([0, 0, 1, 0]))).to.throw(FrameError, /runs past the frame/);
  });

  describe('against the real torch engine', function () {
    this.timeout(300_000);
    let engine: EngineProcess;
    before(async () => {
      ensureTinyModel(defaultPython());
      engine = new EngineProcess({ python: defaultPython(), device: 'cpu', log });
      engine.start();
      await engine.call('load_base', { name: 'tiny', path: TINY_MODEL_DIR });
      await engine.call('create_model', {
        model_id: 'p',
        base_model: 'tiny',
        lora: { rank: 4, seed: 1, train_unembed: true, train_mlp: true, train_attn: true },
      });
    });
    after(() => engine.stop());

    it('speaks protocol 2', async () => {
      const hello = await engine.call('hello', {});
      expect(hello).to.include({ protocol: PROTOCOL_VERSION, engine: 'torch', device: 'cpu' });
    });

    it('answers forward_backward with binary logprobs that equal the loss it reports', async () => {
      const tokens = [5, 17, 300, 42, 9, 77];
      const targets = [17, 300, 42, 9, 77, 1];
      const weights = [0, 1, 1, 1, 0.5, 1];
      const r = await engine.call('forward_backward', {
        model_id: 'p',
        loss_fn: 'cross_entropy',
        loss_fn_config: {},
        forward_only: true,
        data: [
          {
            tokens: BinTensor.ints([6], tokens),
            loss_fn_inputs: {
              target_tokens: BinTensor.from({ dtype: 'int64', shape: [6], data: targets }),
              weights: BinTensor.from({ dtype: 'float32', shape: [6], data: weights }),
            },
          },
        ],
      });
      const lp = r.loss_fn_outputs[0]!.logprobs!;
      expect(lp.dtype).to.equal('float32');
      expect(lp.shape).to.deep.equal([6]);
      for (const v of lp.data) expect(v).to.be.lessThan(0);
      // loss:sum = −Σ w·lp, summed by the engine in float32 over 6 terms: relative error ≤ 6·2⁻²⁴.
      const mine = -lp.data.reduce((s, v, i) => s + v * weights[i]!, 0);
      expect(Math.abs(r.metrics['loss:sum']! - mine)).to.be.at.most(6 * 2 ** -24 * Math.abs(mine) + 1e-7);
    });

    it('refuses arguments that break the op schema before they reach the engine', async () => {
      const bad = { model_id: 'p', adam: { learning_rate: 1, beta1: 1.5 } };
      const err = await engine.call('optim_step', bad).then(
        () => null,
        (e: unknown) => e,
      );
      expect(err).to.be.instanceOf(EngineError);
      expect((err as EngineError).message).to.match(/^the agent built invalid optim_step arguments: adam\.beta1/);
    });

    it('sends every field: the defaults of queues/contract/params.ts fill what a call leaves out', async () => {
      // The engine requires every field of adam (protocol.json); the agent's parse of the args adds the defaults.
      const r = await engine.call('optim_step', { model_id: 'p', adam: { learning_rate: 0 } });
      expect(r.metrics.learning_rate).to.equal(0);
    });

    it('a user error from the engine is a user error here', async () => {
      const err = await engine
        .call('forward_backward', {
          model_id: 'p',
          loss_fn: 'cross_entropy',
          loss_fn_config: {},
          forward_only: true,
          data: [{ tokens: BinTensor.ints([2], [5, 999_999]), loss_fn_inputs: { target_tokens: BinTensor.ints([2], [1, 2]) } }],
        })
        .then(
          () => null,
          (e: unknown) => e,
        );
      expect(err).to.be.instanceOf(EngineError);
      expect((err as EngineError).code).to.equal('INVALID_REQUEST');
      expect((err as EngineError).message).to.match(/token id 999999 at position 1 is outside the vocabulary/);
    });
  });
});
