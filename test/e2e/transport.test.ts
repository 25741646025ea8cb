import { expect } from 'chai';
import { TINY_MODEL_ALIAS, TINY_MODEL_DIR } from '../../scripts/stack.js';
import { E2EServer } from './server.js';

/**
 * The SDK's fast transport paths, as `/client/config` turns them on: its pyqwest (reqwest) HTTP
 * transport for every pool but the config fetch, and zstd-compressed forward_backward bodies.
 * `sdk_transport.py` runs against a server with a 300 ms long poll (futures end in try_again and are
 * polled again) and a sampling queue of one (concurrent samples get 429 and are resent): a body of
 * several MB, long polls, retries and error replies all go through pyqwest.
 */
describe('SDK transport: pyqwest and zstd forward_backward bodies', function () {
  this.timeout(600_000);
  // info: every 429 is logged (api/app.ts), as JSON.
  const server = new E2EServer({ TB_LONG_POLL_MS: '300', TB_MAX_QUEUED_SAMPLES: '1', TB_LOG_LEVEL: 'info', TB_LOG_FORMAT: 'json' });
  let out: any;
  before(async function () {
    this.timeout(300_000);
    await server.start();
    out = server.runPython(['test/e2e/sdk_transport.py', TINY_MODEL_ALIAS, TINY_MODEL_DIR]);
  });
  after(async () => server.destroy());

  it('resolves both flags on, and every pool the SDK opened uses the pyqwest transport', () => {
    expect(out.config).to.deep.equal({ use_pyqwest_transport: true, proto_compress_fwdbwd: true });
    expect(Object.keys(out.transports)).to.include.members(['train', 'sample', 'retrieve_promise']);
    for (const [pool, classes] of Object.entries(out.transports)) expect(classes, pool).to.deep.equal(['AsyncPyqwestTransport']);
  });

  it('trains a body of several MB, zstd-compressed, to the torch reference', () => {
    const { large } = out;
    // The largest body the SDK compressed: the (2000, 128) top-K datum's ~3 MB of protobuf.
    expect(large.body_bytes).to.be.above(3_000_000);
    expect(out.compressed_bodies).to.be.at.least(4);
    expect(large.loss_server).to.be.closeTo(large.loss_ref, 1e-4 * Math.abs(large.loss_ref));
    expect(large.loss_forward).to.be.closeTo(large.loss_ref, 1e-4 * Math.abs(large.loss_ref));
    expect(large.max_logprob_diff).to.be.below(1e-4);
    expect(out.optim).to.have.property('grad_norm');
  });

  it('polls futures through try_again, and resends samples the full queue refused with 429', () => {
    // The long sample (up to 1024 tokens) outlasts the 300 ms long poll.
    expect(out.try_again).to.be.above(0);
    expect(out.long_sample).to.be.within(1, 1024);
    expect(out.samples).to.have.length(6);
    for (const n of out.samples) expect(n).to.be.within(1, 64);
    expect(server.log.match(/"status":429/g)?.length ?? 0, 'the server answered 429').to.be.above(0);
  });

  it('raises the server’s error replies as the SDK’s typed errors, and keeps working after them', () => {
    expect(out.errors.oov_token).to.match(/^BadRequestError: .*999999 is outside the vocabulary/);
    expect(out.errors.unknown_model).to.match(/^NotFoundError: .*base model 'Qwen\/Qwen3-8B' is not served here/);
    expect(out.errors.unknown_run).to.match(/^NotFoundError: .*unknown model_id 'no-such-run'/);
    expect(out.after_errors_loss).to.be.a('number').and.above(0);
  });
});
