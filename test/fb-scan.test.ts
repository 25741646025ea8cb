import { expect } from 'chai';
import { ForwardBackwardScan, type ScanLimits } from '../api/wire/fb-scan.js';
import { encodeForwardBackward, encodeForwardBackwardMessage, i32, i64 } from './helpers/wire.js';

/** The streaming look at forward_backward bodies (api/wire/fb-scan.ts), fed in pieces of every size. */
describe('forward_backward body scan', () => {
  const limits: ScanLimits = { maxTokens: 2048, maxTensorBytes: 2048 * 128 * 8 };
  const scanIn = (body: Buffer, piece: number, l = limits) => {
    const scan = new ForwardBackwardScan(l);
    let fed = 0;
    for (let o = 0; o < body.length && !scan.refusal; o += piece) {
      scan.push(body.subarray(o, o + piece));
      fed = Math.min(body.length, o + piece);
    }
    return { scan, fed };
  };
  const datum = (n: number) => ({ tokens: Array.from({ length: n }, (_, i) => i % 1000), targets: Array.from({ length: n }, (_, i) => (i + 1) % 1000) });

  for (const piece of [1, 3, 7, 64, 1 << 20]) {
    it(`pieces of ${piece} B: keeps model_id and seq_id, passes datums within the bounds, refuses the first one past them`, () => {
      const ok = encodeForwardBackward({ modelId: 'sess-1:train:0', seqId: 42, data: [datum(5), datum(2048), datum(1)] });
      const a = scanIn(ok, piece);
      expect(a.scan.refusal).to.equal(null);
      expect([a.scan.modelId, a.scan.seqId]).to.deep.equal(['sess-1:train:0', 42]);

      const long = encodeForwardBackward({ modelId: 'm', seqId: 7, data: [datum(3), datum(5000), datum(2)] });
      const b = scanIn(long, piece);
      expect(b.scan.refusal?.message).to.equal('data[1]: 5000 tokens or more exceed the longest context served here (2048)');
      expect([b.scan.modelId, b.scan.seqId]).to.deep.equal(['m', 7]);
      // Refused once the datum's token length arrived (byte ~100 of 60 kB), not after its arrays.
      expect(long.length).to.be.above(60_000);
      expect(b.fed).to.be.below(Math.max(200, piece + 1));
    });
  }

  it('refuses a loss input larger than any served model accepts, dense or sparse, from its length alone', () => {
    const dense = encodeForwardBackwardMessage({
      model_id: 'm',
      seq_id: 1,
      data: [{ model_input: [{ encoded_text: { tokens: i32([5]) } }], loss_fn_inputs: { target_tokens: { dense: i64(Array(300).fill(1)), dtype: 2, shape: [300] } } }],
    });
    const small = { maxTokens: 16, maxTensorBytes: 16 * 8 };
    expect(scanIn(dense, 5, small).scan.refusal?.message).to.match(/^data\[0\]: a loss_fn_inputs tensor of 2400 bytes is larger than any model served here accepts \(128\)$/);
    const sparse = encodeForwardBackwardMessage({
      model_id: 'm',
      seq_id: 1,
      data: [
        {
          model_input: [{ encoded_text: { tokens: i32([5]) } }],
          loss_fn_inputs: { target_tokens: { sparse_csr: { values: i64(Array(20).fill(1)), crow_indices: i64([0, 20]), col_indices: i64(Array(20).fill(0)) }, dtype: 2, shape: [1, 20] } },
        },
      ],
    });
    expect(scanIn(sparse, 1, small).scan.refusal?.message).to.match(/tensor of 160 bytes/);
    expect(scanIn(sparse, 1, limits).scan.refusal).to.equal(null);
  });

  it('stops quietly on a malformed body (the full decoder reports it)', () => {
    const junk = Buffer.from([0x1a, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x01, 0x0b, 0x00]);
    expect(scanIn(junk, 1).scan.refusal).to.equal(null);
    expect(scanIn(Buffer.alloc(3 * 2 ** 20, 1), 65536).scan.refusal).to.equal(null);
  });
});
