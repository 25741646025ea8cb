import { expect } from 'chai';
import { TINY_MODEL_ALIAS } from '../../scripts/stack.js';
import { call } from '../helpers/stack.js';
import { E2E_KEY, E2EServer } from './server.js';

/**
 * Server-side custom losses (issue 36 item 4) through the real SDK and stack: `sdk_custom_loss.py`
 * runs one traced loss on the server (create_custom_loss, then forward_backward with loss_fn custom)
 * and, on a twin model, on the client (the SDK's own forward + surrogate path); both must report the
 * same loss and metrics and stay equal after two AdamW steps. Hostile graphs posted over HTTP are
 * refused naming the node; another API key can neither run nor see a tenant's loss. A second loss takes
 * rank-0 (scalar) inputs, equal on both paths too; a scalar for a built-in loss and a request past the
 * scalar cap are 400s.
 */
const OTHER_KEY = 'tml-e2e-other';

type Metrics = Record<string, number>;
type Step = { server: Metrics; client: Metrics; logprob_diff: number; grad_norm: [number, number] };
type Out = {
  server_side: boolean;
  loss_id: string;
  steps: Step[];
  after_logprob_diff: number;
  missing_input_error: string;
  other_tenant_error: string;
  scalar_loss_id: string;
  scalar_step: Step;
  plain_scalar_error: string;
  past_cap_error: string;
};

/**
 * Float32 tolerance. Both paths run the same forward (same micro-batches, same kernels) and the same
 * graph ops on the same logprobs; the gradient reaching the logprobs is dC/dlp in both (the client's
 * surrogate backward of -(w * lp).sum() with w = -dC/dlp hands back exactly dC/dlp). What differs
 * is the rounding of a few sums (the loss summed in a different association, float32 vs float64
 * metric sums): relative 1e-5 is ~100 float32 ulps. After two steps the weights may differ by the
 * rounding of the steps themselves, so logprobs get an absolute 1e-4 (they are ~-5).
 */
const REL = 1e-5;
const close = (a: number, b: number) => Math.abs(a - b) <= REL * Math.max(1, Math.abs(a), Math.abs(b));

const LP = { ref: 'logprobs' };
const graph = (...nodes: Record<string, unknown>[]) => ({
  format: 1,
  nodes: [
    { op: 'placeholder', name: 'logprobs', target: 'logprobs', args: [], kwargs: {} },
    ...nodes.map((n) => ({ args: [], kwargs: {}, ...n })),
    { op: 'output', name: 'output', target: 'output', args: [{ tuple: [{ ref: nodes.length ? nodes[nodes.length - 1]!.name : 'logprobs' }, { dict: {} }] }], kwargs: {} },
  ],
});
const fn = (name: string, target: string, ...args: unknown[]) => ({ op: 'call_function', name, target, args });

describe('server-side custom losses through the SDK', function () {
  const server = new E2EServer({ TB_API_KEYS: `${E2E_KEY},${OTHER_KEY}` });
  let out: Out;

  before(async function () {
    this.timeout(400_000);
    await server.start();
    out = server.runPython(['test/e2e/sdk_custom_loss.py', TINY_MODEL_ALIAS, OTHER_KEY], 300_000) as Out;
  });
  after(async () => server.destroy());

  it('the server tells the SDK to upload custom losses, and create_custom_loss answers a loss id', () => {
    expect(out.server_side).to.equal(true);
    expect(out.loss_id).to.match(/:loss:0$/);
  });

  it('server-side and client-side runs report the same loss:sum and custom metrics, step after step', () => {
    expect(out.steps).to.have.length(2);
    for (const [i, s] of out.steps.entries()) {
      const ctx = `step ${i}: ${JSON.stringify(s)}`;
      // The client-side path adds surrogate_loss:sum (its cross_entropy backward's own loss); the server runs no surrogate.
      const { 'surrogate_loss:sum': _surrogate, ...client } = s.client;
      expect(Object.keys(s.server).sort(), ctx).to.deep.equal(Object.keys(client).sort());
      expect(Object.keys(s.server), ctx).to.include.members(['loss:sum', 'custom/entropy:mean', 'custom/clipped:sum']);
      for (const k of Object.keys(client)) expect(close(s.server[k]!, client[k]!), `${k}: ${ctx}`).to.equal(true);
      expect(s.logprob_diff, ctx).to.be.below(1e-4);
      expect(close(s.grad_norm[0], s.grad_norm[1]), ctx).to.equal(true);
      expect(s.grad_norm[0], ctx).to.be.above(0);
    }
    // The first step moved the weights: the second step's loss differs from the first's.
    expect(out.steps[1]!.server['loss:sum']).to.not.equal(out.steps[0]!.server['loss:sum']);
    expect(out.after_logprob_diff).to.be.below(1e-4);
  });

  it('a loss with rank-0 (scalar) inputs runs on the server as on the client, a one-token datum included', () => {
    expect(out.scalar_loss_id).to.match(/:loss:1$/);
    const s = out.scalar_step;
    const ctx = JSON.stringify(s);
    const { 'surrogate_loss:sum': _surrogate, ...client } = s.client;
    expect(Object.keys(s.server).sort(), ctx).to.deep.equal(Object.keys(client).sort());
    expect(Object.keys(s.server), ctx).to.include.members(['loss:sum', 'custom/adv:mean', 'custom/group:sum']);
    for (const k of Object.keys(client)) expect(close(s.server[k]!, client[k]!), `${k}: ${ctx}`).to.equal(true);
    // group is 2, 3 and 4 over the three datums: the int64 scalars arrived whole.
    expect(s.server['custom/group:sum'], ctx).to.equal(9);
    expect(s.logprob_diff, ctx).to.be.below(1e-4);
    expect(close(s.grad_norm[0], s.grad_norm[1]), ctx).to.equal(true);
    expect(s.grad_norm[0], ctx).to.be.above(0);
  });

  it('a scalar where a built-in loss needs a per-token tensor is a 400', () => {
    expect(out.plain_scalar_error).to.include('BadRequestError');
    expect(out.plain_scalar_error).to.include(
      "data[0].loss_fn_inputs.advantages is a rank-0 (scalar) tensor; loss_fn 'importance_sampling' takes (N,) or (N, K) inputs",
    );
  });

  it('a request past the cap on scalar inputs is a 400', () => {
    expect(out.past_cap_error).to.include('BadRequestError');
    expect(out.past_cap_error).to.include('more than 16384 rank-0 (scalar) loss inputs in one forward_backward request');
  });

  it('a datum without an input the loss reads is refused, naming it', () => {
    expect(out.missing_input_error).to.include("reads loss_fn_inputs.adv, which the datum lacks");
  });

  it('another API key cannot run the loss', () => {
    expect(out.other_tenant_error).to.include(`unknown custom loss '${out.loss_id}'`);
  });

  describe('hostile graphs posted over HTTP are refused with the node named', () => {
    let session = '';
    let seq = 100;
    before(async () => {
      session = (await call(server.baseUrl, 'POST', '/create_session', { tags: [] }, { key: E2E_KEY })).json.session_id;
    });
    const cases: [string, ReturnType<typeof graph>, string][] = [
      ['an import', graph(fn('imp', 'builtins.__import__', 'os')), "node 'imp' names 'builtins.__import__'"],
      ['os.system', graph(fn('sh', 'os.system', 'touch /tmp/pwned')), "node 'sh' calls 'os.system', which is not an allowed operation"],
      ['builtins.open', graph(fn('f', 'builtins.open', '/etc/passwd')), "node 'f' calls 'builtins.open'"],
      ['eval', graph(fn('e', 'eval', '1')), "node 'e' calls 'eval'"],
      ['a dunder attribute', graph(fn('c', 'getattr', LP, '__class__')), "node 'c' reads the attribute '__class__'"],
      ['__globals__', graph(fn('g', 'getattr', LP, '__globals__')), "node 'g' reads the attribute '__globals__'"],
      ['get_attr', graph({ op: 'get_attr', name: 'w', target: 'weight' }), "node 'w' reads the attribute 'weight' of the traced module (get_attr)"],
      ['call_module', graph({ op: 'call_module', name: 'm', target: 'lin', args: [LP] }), "node 'm' calls the module 'lin'"],
      ['a huge constant', graph(fn('z', 'torch.ones', 1e12)), "node 'z' has the integer constant 1000000000000"],
      ['a big list', graph(fn('z', 'torch.tensor', Array.from({ length: 1000 }, () => 1))), "node 'z' has a list of 1000 items"],
      ['a forward reference', graph(fn('a', 'torch.exp', { ref: 'b' }), fn('b', 'torch.exp', LP)), "node 'a' refers to 'b', which is not a node defined before it"],
    ];
    for (const [what, g, message] of cases) {
      it(what, async () => {
        const r = await call(server.baseUrl, 'POST', '/create_custom_loss', { session_id: session, custom_loss_seq_id: seq++, name: 'evil', inputs: [{ name: 'logprobs', rank: 1 }], graph: g }, { key: E2E_KEY });
        expect(r.status, JSON.stringify(r.json)).to.equal(400);
        expect(r.json.category).to.equal('user');
        expect(r.json.error).to.include(message);
      });
    }

    it("a tenant's loss future and session are invisible to another key", async () => {
      const body = { session_id: session, custom_loss_seq_id: 7, name: 'ok', inputs: [{ name: 'logprobs', rank: 1 }], graph: graph(fn('s', 'torch.sum', LP)) };
      // Another key cannot create a loss in this session.
      const refused = await call(server.baseUrl, 'POST', '/create_custom_loss', body, { key: OTHER_KEY });
      expect(refused.status, JSON.stringify(refused.json)).to.equal(404);
      const created = await call(server.baseUrl, 'POST', '/create_custom_loss', body, { key: E2E_KEY });
      expect(created.status, JSON.stringify(created.json)).to.equal(200);
      const theirs = await call(server.baseUrl, 'POST', '/retrieve_future', { request_id: created.json.request_id }, { key: OTHER_KEY });
      expect(theirs.status).to.equal(404);
      const mine = await call(server.baseUrl, 'POST', '/retrieve_future', { request_id: created.json.request_id }, { key: E2E_KEY });
      expect(mine.json).to.deep.equal({ type: 'create_custom_loss', loss_id: `${session}:loss:7` });
      // The same create again names the same loss; another graph under that seq_id is a conflict.
      const again = await call(server.baseUrl, 'POST', '/create_custom_loss', body, { key: E2E_KEY });
      expect(again.status).to.equal(200);
      const other = await call(server.baseUrl, 'POST', '/create_custom_loss', { ...body, graph: graph(fn('s', 'torch.mean', LP)) }, { key: E2E_KEY });
      expect(other.status).to.equal(409);
    });
  });
});
