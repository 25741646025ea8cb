import { expect } from 'chai';
import { z } from 'zod';
import { Datum, Tensor } from '../queues/contract/schemas.js';

/**
 * The number arrays of the job contract (a datum's tokens, a tensor's data) are checked in one loop
 * instead of a zod schema per element: they must accept exactly what zod's arrays of numbers and of
 * integers accept, and say which element is wrong.
 */
describe('job contract: number arrays', () => {
  const values: unknown[] = [0, -0, 1, -7, 1.5, -1e30, 2 ** 53 - 1, 2 ** 53, -(2 ** 60), NaN, Infinity, -Infinity, '1', null, undefined, true, [1], {}];

  it("accepts exactly the values zod's z.array(z.number()) and z.array(z.number().int()) accept", () => {
    for (const v of values) {
      for (const arr of [[v], [1, v], [v, 2, 3]]) {
        expect(Tensor.safeParse({ dtype: 'float32', shape: [arr.length], data: arr }).success, `data ${String(v)}`).to.equal(z.array(z.number()).safeParse(arr).success);
        expect(Datum.safeParse({ tokens: arr, loss_fn_inputs: {} }).success, `tokens ${String(v)}`).to.equal(z.array(z.number().int()).safeParse(arr).success);
      }
    }
    for (const notArray of ['1,2', null, { 0: 1 }, 3]) {
      expect(Tensor.safeParse({ dtype: 'float32', shape: [1], data: notArray }).success).to.equal(false);
      expect(Datum.safeParse({ tokens: notArray, loss_fn_inputs: {} }).success).to.equal(false);
    }
  });

  it('names the first element that is not a number of the kind, and an empty datum', () => {
    const msg = (r: { error?: { issues: { path: PropertyKey[]; message: string }[] } }) => r.error!.issues.map((i) => `${i.path.join('.')}: ${i.message}`);
    expect(msg(Datum.safeParse({ tokens: [1, 2, 1.5, 'x'], loss_fn_inputs: {} }))).to.deep.equal(['tokens: expected an array of integers; element 2 is 1.5']);
    expect(msg(Datum.safeParse({ tokens: [], loss_fn_inputs: {} }))).to.deep.equal(['tokens: expected at least one token']);
    expect(msg(Datum.safeParse({ tokens: 'abc', loss_fn_inputs: {} }))).to.deep.equal(['tokens: expected an array of integers, got string']);
    const t = (data: unknown) => msg(Tensor.safeParse({ dtype: 'float32', shape: [2], data }));
    expect(t([0.5, NaN])).to.deep.equal(['data: expected an array of finite numbers; element 1 is NaN']);
    expect(t([0.5, '1'])).to.deep.equal(['data: expected an array of finite numbers; element 1 is "1"']);
    expect(t(null)).to.deep.equal(['data: expected an array of finite numbers, got null']);
  });
});
