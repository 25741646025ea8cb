import { expect } from 'chai';
import { spawnSync } from 'node:child_process';
import { decodeForwardBackwardRequest, type DecodeLimits } from '../api/wire/proto.js';
import { customLossInputs, CUSTOM_LOSS_OPS, type CustomLossSpec } from '../queues/contract/custom-loss.js';
import { BrokerError } from '../queues/contract/errors.js';
import { defaultPython } from '../scripts/stack.js';
import { encodeForwardBackwardMessage, f32, i32 } from './helpers/wire.js';

/**
 * Rank-0 (scalar) custom loss inputs on the forward_backward wire. The bodies are made by the SDK's
 * own encoder (tinker.proto.request_conv, SDK 0.38): a 0-d tensor goes out as one element with no
 * shape, since protobuf cannot send an empty shape. The decoder (api/wire/proto.ts) reads it as a
 * scalar for a custom loss, under a cap per request, and refuses it for every other loss; the
 * custom loss's declared ranks (queues/contract/custom-loss.ts) settle the one-token datum, whose
 * one element reads as (1,).
 */
const LIMITS: DecodeLimits = { maxTokens: 64, vocabSize: 1000, maxK: 128 };

/** Each named request, encoded by the SDK: [name, loss_fn, datums as [tokens, {input: python expr}]]. */
type SdkRequest = [string, string, [number[], Record<string, string>][]];

function sdkBodies(requests: SdkRequest[]): Record<string, Buffer> {
  const code = [
    'import base64, json, sys',
    'import numpy as np, torch',
    'from tinker import types',
    'from tinker.proto.request_conv import forward_backward_request_to_proto',
    'out = {}',
    'for name, loss_fn, data in json.load(sys.stdin):',
    '    datums = [types.Datum(model_input=types.ModelInput.from_ints(tokens),',
    '                          loss_fn_inputs={k: eval(v, {"torch": torch, "np": np, "types": types}) for k, v in inputs.items()})',
    '              for tokens, inputs in data]',
    '    req = types.ForwardBackwardRequest(forward_backward_input=types.ForwardBackwardInput(data=datums, loss_fn=loss_fn,',
    '        loss_fn_config={"loss_id": "s:loss:0"} if loss_fn == "custom" else None), model_id="m:train:0", seq_id=1)',
    '    out[name] = base64.b64encode(forward_backward_request_to_proto(req).SerializeToString()).decode()',
    'print(json.dumps(out))',
  ].join('\n');
  const r = spawnSync(defaultPython(), ['-c', code], { input: JSON.stringify(requests), encoding: 'utf8', maxBuffer: 1 << 28 });
  expect(r.status, r.stderr).to.equal(0);
  const out = JSON.parse(r.stdout.trim().split('\n').pop()!) as Record<string, string>;
  return Object.fromEntries(Object.entries(out).map(([k, v]) => [k, Buffer.from(v, 'base64')]));
}

const targets = (n: number) => `torch.arange(${n}, dtype=torch.int64)`;
const scalarDatum = (n: number, adv: string): [number[], Record<string, string>] => [
  Array.from({ length: n }, (_, i) => i + 1),
  { target_tokens: targets(n), old: `torch.full((${n},), -2.5)`, adv, group: 'torch.tensor(3)', note: 'torch.tensor(7.0)' },
];
/** Datums of `n` tokens, each with `k` scalar inputs s0..s{k-1}. */
const manyScalars = (datums: number, k: number): [number[], Record<string, string>][] =>
  Array.from({ length: datums }, () => [[1, 2], { target_tokens: targets(2), ...Object.fromEntries(Array.from({ length: k }, (_, j) => [`s${j}`, `torch.tensor(${j}.5)`])) }]);

const SPEC = (ranks: Record<string, 0 | 1 | 2>): CustomLossSpec => ({
  name: 'per_sequence',
  inputs: [{ name: 'logprobs', rank: 1 }, ...Object.entries(ranks).map(([name, rank]) => ({ name, rank }))],
  graph: { format: 1, nodes: [] },
});

/** The user error a call throws (a 400), or a failure when it does not. */
function refusal(f: () => unknown): string {
  try {
    f();
  } catch (e) {
    expect(e).to.be.instanceOf(BrokerError);
    expect((e as BrokerError).code).to.equal('INVALID_REQUEST');
    return (e as Error).message;
  }
  throw new Error('expected a refusal');
}

describe('rank-0 (scalar) custom loss inputs on the forward_backward wire', function () {
  this.timeout(120_000);
  const cap = CUSTOM_LOSS_OPS.max_scalar_inputs;
  const perDatum = CUSTOM_LOSS_OPS.max_inputs;
  let bodies: Record<string, Buffer>;
  before(() => {
    const scalars = [scalarDatum(7, 'torch.tensor(0.25)'), scalarDatum(1, 'torch.tensor(-1.5)'), scalarDatum(4, 'np.array(2.0, dtype=np.float32)')];
    bodies = sdkBodies([
      ['custom', 'custom', scalars],
      ['plain', 'importance_sampling', [[[1, 2, 3], { target_tokens: targets(3), logprobs: 'torch.zeros(3)', advantages: 'torch.tensor(1.0)' }]]],
      // The SDK's default chunk (1024 datums) with max_inputs scalars each is exactly the cap.
      ['at_cap', 'custom', manyScalars(cap / perDatum, perDatum)],
      ['past_cap', 'custom', manyScalars(cap / perDatum + 1, perDatum)],
    ]);
  });

  it('the SDK sends a 0-d tensor as one element with no shape', () => {
    expect(cap).to.equal(1024 * perDatum);
    const data = decodeForwardBackwardRequest(bodies.custom!).data(LIMITS);
    expect(data[0]!.loss_fn_inputs.adv).to.deep.equal({ dtype: 'float32', shape: [], data: [0.25] });
    expect(data[0]!.loss_fn_inputs.group).to.deep.equal({ dtype: 'int64', shape: [], data: [3] });
    expect(data[0]!.loss_fn_inputs.old!.shape).to.deep.equal([7]);
    // One token: one element reads as (1,), as an unshaped 1-D list would; the loss's ranks settle it.
    expect(data[1]!.loss_fn_inputs.adv).to.deep.equal({ dtype: 'float32', shape: [1], data: [-1.5] });
    expect(data[2]!.loss_fn_inputs.adv).to.deep.equal({ dtype: 'float32', shape: [], data: [2] });
  });

  it("a custom loss's declared rank 0 takes them as scalars, the one-token datum's too, and drops what it does not read", () => {
    const data = decodeForwardBackwardRequest(bodies.custom!).data(LIMITS);
    const kept = data.map((d, i) => customLossInputs(SPEC({ old: 1, adv: 0, group: 0 }), d.loss_fn_inputs, `data[${i}]`));
    expect(kept.map((k) => Object.keys(k))).to.deep.equal(Array(3).fill(['target_tokens', 'old', 'adv', 'group']));
    expect(kept.map((k) => k.adv!.shape)).to.deep.equal([[], [], []]);
    expect(kept.map((k) => k.adv!.data)).to.deep.equal([[0.25], [-1.5], [2]]);
    expect(kept[1]!.old!.shape).to.deep.equal([1]);
  });

  it('a scalar where the loss declared a per-token input is a 400 naming it', () => {
    const data = decodeForwardBackwardRequest(bodies.custom!).data(LIMITS);
    expect(refusal(() => customLossInputs(SPEC({ old: 1, adv: 1 }), data[0]!.loss_fn_inputs, 'data[0]'))).to.equal(
      "data[0]: loss_fn_inputs.adv has rank 0, but custom loss 'per_sequence' declared it with rank 1",
    );
    // And a per-token input where it declared a scalar.
    expect(refusal(() => customLossInputs(SPEC({ old: 0 }), data[0]!.loss_fn_inputs, 'data[0]'))).to.include('loss_fn_inputs.old has rank 1');
  });

  it('every other loss refuses a scalar input, whatever the limit says: its inputs are per token', () => {
    const message =
      "data[0].loss_fn_inputs.advantages is a rank-0 (scalar) tensor; loss_fn 'importance_sampling' takes (N,) or (N, K) inputs with N = the datum's 3 tokens (only custom losses take scalars)";
    expect(refusal(() => decodeForwardBackwardRequest(bodies.plain!).data(LIMITS))).to.equal(message);
    expect(refusal(() => decodeForwardBackwardRequest(bodies.plain!).data({ ...LIMITS, scalarInputs: 100 }))).to.equal(message);
  });

  it(`at most max_scalar_inputs scalars in one request: the SDK's chunk of 1024 datums x ${perDatum} fits, one datum more is a 400`, () => {
    const data = decodeForwardBackwardRequest(bodies.at_cap!).data(LIMITS);
    expect(data).to.have.length(cap / perDatum);
    expect(data.every((d) => d.loss_fn_inputs.s15!.shape.length === 0)).to.equal(true);
    expect(refusal(() => decodeForwardBackwardRequest(bodies.past_cap!).data(LIMITS))).to.match(
      new RegExp(`^data\\[1024\\]\\.loss_fn_inputs\\.s[0-9]+: more than ${cap} rank-0 \\(scalar\\) loss inputs in one forward_backward request; send fewer datums per request$`),
    );
    // The cap is the decoder's limit: a caller may lower it.
    expect(refusal(() => decodeForwardBackwardRequest(bodies.custom!).data({ ...LIMITS, scalarInputs: 3 }))).to.include('more than 3 rank-0 (scalar) loss inputs');
  });

  it('an unshaped tensor is a scalar only with exactly one element; any other size is refused from its byte count', () => {
    const body = (dense: Buffer) =>
      encodeForwardBackwardMessage({
        model_id: 'm:train:0',
        seq_id: 1,
        loss_fn: 'custom',
        data: [{ model_input: [{ encoded_text: { tokens: i32([1, 2, 3]) } }], loss_fn_inputs: { adv: { dtype: 1, dense } } }],
      });
    // 64 MiB of floats with no shape: refused by its element count, never read into an array.
    expect(refusal(() => decodeForwardBackwardRequest(body(Buffer.alloc(64 << 20))).data(LIMITS))).to.equal(
      'data[0].loss_fn_inputs.adv has shape [16777216] but model_input has 3 tokens',
    );
    expect(refusal(() => decodeForwardBackwardRequest(body(Buffer.alloc(0))).data(LIMITS))).to.include('has shape [0] but model_input has 3 tokens');
    expect(refusal(() => decodeForwardBackwardRequest(body(Buffer.alloc(6))).data(LIMITS))).to.include('6 bytes is not a whole number of 4-byte elements');
    expect(decodeForwardBackwardRequest(body(f32([0.5]))).data(LIMITS)[0]!.loss_fn_inputs.adv).to.deep.equal({ dtype: 'float32', shape: [], data: [0.5] });
  });
});
