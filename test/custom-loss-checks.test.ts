import { expect } from 'chai';
import { spawnSync } from 'node:child_process';
import path from 'node:path';
import { checkCustomLoss, CustomLossSpec, CUSTOM_LOSS_OPS } from '../queues/contract/custom-loss.js';
import { defaultPython } from '../scripts/stack.js';

/**
 * The API's checks of a custom loss graph (queues/contract/custom-loss.ts) and the engine's rebuild
 * (workers/python/tinker_engine/custom_loss.py) read one allowlist; here each graph below is given to
 * both, and both must accept it or both refuse it, naming the same node.
 */
const LP = { ref: 'logprobs' };
const spec = (...nodes: Record<string, unknown>[]) => ({
  name: 'l',
  inputs: [{ name: 'logprobs', rank: 1 }],
  graph: {
    format: 1,
    nodes: [
      { op: 'placeholder', name: 'logprobs', target: 'logprobs', args: [], kwargs: {} },
      ...nodes.map((n) => ({ args: [], kwargs: {}, ...n })),
      { op: 'output', name: 'output', target: 'output', args: [{ tuple: [{ ref: nodes.length ? nodes[nodes.length - 1]!.name : 'logprobs' }, { dict: { 'custom/m:sum': LP } }] }], kwargs: {} },
    ],
  },
});
const fn = (name: string, target: string, args: unknown[] = [LP], kwargs: Record<string, unknown> = {}) => ({ op: 'call_function', name, target, args, kwargs });
const method = (name: string, target: string, args: unknown[] = [LP], kwargs: Record<string, unknown> = {}) => ({ op: 'call_method', name, target, args, kwargs });

/** [what, graph, the node a refusal names (null: accepted)]. */
const CASES: [string, ReturnType<typeof spec>, string | null][] = [
  ['every allowed function with a tensor', spec(...CUSTOM_LOSS_OPS.functions.filter((f) => f.startsWith('torch.') && !f.startsWith('torch.nn')).slice(0, 40).map((f, i) => fn(`f${i}`, f))), null],
  ['every allowed method', spec(...CUSTOM_LOSS_OPS.methods.filter((m) => m !== 'to').map((m, i) => method(`m${i}`, m))), null],
  ['to(dtype)', spec(method('t', 'to', [LP, { dtype: 'float64' }])), null],
  ['getattr shape', spec(fn('s', 'getattr', [LP, 'shape']), fn('n', 'operator.getitem', [{ ref: 's' }, 0])), null],
  ['F.relu inplace=False', spec(fn('r', 'torch.nn.functional.relu', [LP], { inplace: false })), null],
  ['slices, ellipsis, inf', spec(fn('g', 'operator.getitem', [LP, { tuple: [{ ellipsis: true }, { slice: [1, null, null] }] }]), fn('c', 'torch.clamp', [{ ref: 'g' }, { float: '-inf' }, 0])), null],
  ['os.system', spec(fn('sh', 'os.system', ['ls'])), 'sh'],
  ['__import__', spec(fn('i', 'builtins.__import__', ['os'])), 'i'],
  ['eval', spec(fn('e', 'eval', ['1'])), 'e'],
  ['__class__', spec(fn('c', 'getattr', [LP, '__class__'])), 'c'],
  ['grad_fn', spec(fn('c', 'getattr', [LP, 'grad_fn'])), 'c'],
  ['dunder method', spec(method('d', '__reduce__')), 'd'],
  ['numpy()', spec(method('n', 'numpy')), 'n'],
  ['in-place add_', spec(method('a', 'add_', [LP, 1])), 'a'],
  ['out=', spec(fn('o', 'torch.exp', [LP], { out: LP })), 'o'],
  ['inplace=True', spec(fn('o', 'torch.nn.functional.relu', [LP], { inplace: true })), 'o'],
  ['to(device)', spec(method('t', 'to', [LP, 'cuda'])), 't'],
  ['get_attr', spec({ op: 'get_attr', name: 'w', target: 'weight' }), 'w'],
  ['call_module', spec({ op: 'call_module', name: 'm', target: 'lin', args: [LP] }), 'm'],
  ['unknown ref', spec(fn('a', 'torch.exp', [{ ref: 'zz' }])), 'a'],
  ['self ref', spec(fn('a', 'torch.exp', [{ ref: 'a' }])), 'a'],
  ['forward ref', spec(fn('a', 'torch.exp', [{ ref: 'b' }]), fn('b', 'torch.exp')), 'a'],
  ['duplicate', spec(fn('a', 'torch.exp'), fn('a', 'torch.exp')), 'a'],
  ['huge int', spec(fn('z', 'torch.zeros', [2 ** 40])), 'z'],
  ['big list', spec(fn('z', 'torch.tensor', [Array.from({ length: 100 }, () => 0)])), 'z'],
  ['long string', spec(fn('z', 'torch.sum', [LP, 'x'.repeat(100)])), 'z'],
  ['unknown arg kind', spec(fn('z', 'torch.exp', [{ pickle: 'x' }])), 'z'],
  ['bad dtype', spec(method('z', 'to', [LP, { dtype: 'object' }])), 'z'],
];

/** The engine's verdict on each spec: null (rebuilt) or its UserError's message. */
function engineVerdicts(specs: unknown[]): (string | null)[] {
  const code = [
    'import json, sys',
    'from tinker_engine import custom_loss as cl',
    'from tinker_engine.errors import UserError',
    'out = []',
    'for s in json.load(sys.stdin):',
    '    try:',
    '        cl.rebuild(s["name"], s["inputs"], s["graph"]); out.append(None)',
    '    except UserError as e:',
    '        out.append(str(e))',
    'print(json.dumps(out))',
  ].join('\n');
  const r = spawnSync(defaultPython(), ['-c', code], { cwd: path.resolve('workers/python'), input: JSON.stringify(specs), encoding: 'utf8' });
  expect(r.status, r.stderr).to.equal(0);
  return JSON.parse(r.stdout.trim().split('\n').pop()!);
}

function apiVerdict(raw: unknown): string | null {
  try {
    checkCustomLoss(CustomLossSpec.parse(raw));
    return null;
  } catch (e) {
    return (e as Error).message;
  }
}

describe('custom loss graphs: the API and the engine agree (one allowlist)', function () {
  this.timeout(120_000);
  let engine: (string | null)[];
  before(() => {
    engine = engineVerdicts(CASES.map(([, s]) => s));
  });

  for (const [i, [what, s, node]] of CASES.entries()) {
    it(node === null ? `accepts ${what}` : `refuses ${what}, naming node '${node}'`, () => {
      const api = apiVerdict(s);
      if (node === null) {
        expect(api, what).to.equal(null);
        expect(engine[i], what).to.equal(null);
      } else {
        expect(api, what).to.include(`node '${node}'`);
        expect(engine[i], what).to.include(`node '${node}'`);
      }
    });
  }
});
