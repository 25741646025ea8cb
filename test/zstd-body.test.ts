import { spawnSync } from 'node:child_process';
import { randomBytes } from 'node:crypto';
import http from 'node:http';
import path from 'node:path';
import { expect } from 'chai';
import { TINY_MODEL_ALIAS } from '../scripts/stack.js';
import { bodyCoding, ZstdBody } from '../api/wire/zstd.js';
import { awaitFuture, API_KEY, call, startStack, type TestStack } from './helpers/stack.js';
import { decodeForwardBackwardOutput, encodeForwardBackward, encodeForwardBackwardMessage, f32, i32, i64, type TestDatum } from './helpers/wire.js';

/**
 * zstd-compressed forward_backward bodies (`Content-Encoding: zstd`, what the SDK sends with
 * `proto_compress_fwdbwd`; api/wire/zstd.ts). Bodies are compressed here by python-zstandard, the
 * SDK's own compressor. The limits hold on the inflated size: a bomb is refused from its headers,
 * before anything is inflated, and a frame that lies about its size at its first block past it.
 */
const PYTHON = path.resolve('.venv/bin/python');
const MiB = 2 ** 20;

type ZstdOpts = { level?: number; contentSize?: boolean; windowLog?: number; checksum?: boolean };
/** `input` (or the bytes a Python expression makes) compressed by python-zstandard as one frame. */
function pyZstd(input: Buffer | string, o: ZstdOpts = {}): Buffer {
  const params = [
    `write_content_size=${o.contentSize === false ? 'False' : 'True'}`,
    `write_checksum=${o.checksum ? 'True' : 'False'}`,
    ...(o.windowLog ? [`window_log=${o.windowLog}`] : []),
  ].join(', ');
  const code = [
    'import sys, zstandard as z',
    `data = ${typeof input === 'string' ? input : 'sys.stdin.buffer.read()'}`,
    `p = z.ZstdCompressionParameters.from_level(${o.level ?? 3}, ${params})`,
    'sys.stdout.buffer.write(z.ZstdCompressor(compression_params=p).compress(data))',
  ].join('\n');
  const r = spawnSync(PYTHON, ['-c', code], { input: typeof input === 'string' ? undefined : input, maxBuffer: 256 * MiB });
  if (r.status !== 0) throw new Error(`python-zstandard failed: ${r.stderr}`);
  return r.stdout;
}

/** `body` fed to a ZstdBody of limit `max` in pieces of `piece` bytes, then inflated. */
async function inflateIn(body: Buffer, piece: number, max = 64 * MiB): Promise<Buffer> {
  const z = new ZstdBody(max);
  for (let o = 0; o < body.length; o += piece) z.push(body.subarray(o, o + piece));
  return z.inflate();
}

async function refusal(p: Promise<unknown> | (() => unknown)): Promise<string> {
  try {
    await (typeof p === 'function' ? p() : p);
  } catch (e) {
    return (e as Error).message;
  }
  throw new Error('not refused');
}

const datum = (n: number, shift = 0): TestDatum => ({
  tokens: Array.from({ length: n }, (_, i) => (i * 7 + shift) % 1000),
  targets: Array.from({ length: n }, (_, i) => (i * 7 + shift + 1) % 1000),
  weights: Array(n).fill(1),
});

describe('zstd bodies: the frame walk and inflation', function () {
  this.timeout(120_000);
  const plain = encodeForwardBackward({ modelId: 'm', seqId: 1, data: [datum(2048), datum(700, 3)] });

  it('inflates what python-zstandard wrote, fed in pieces of every size', async () => {
    const bodies = {
      declared: pyZstd(plain),
      declaredMultiSegment: pyZstd(plain, { windowLog: 10, checksum: true }),
      streaming: pyZstd(plain, { contentSize: false }),
    };
    for (const [name, body] of Object.entries(bodies)) {
      for (const piece of [1, 7, 4096, body.length]) expect((await inflateIn(body, piece)).equals(plain), `${name}, pieces of ${piece}`).to.equal(true);
    }
    // Several frames and a skippable frame: one body, the frames' contents in order.
    const skippable = Buffer.concat([Buffer.from([0x5a, 0x2a, 0x4d, 0x18, 3, 0, 0, 0]), Buffer.from('abc')]);
    const halves = [plain.subarray(0, 1000), plain.subarray(1000)];
    const multi = Buffer.concat([pyZstd(halves[0]!), skippable, pyZstd(halves[1]!, { contentSize: false })]);
    for (const piece of [1, 5, multi.length]) expect((await inflateIn(multi, piece)).equals(plain)).to.equal(true);
  });

  it('refuses a bomb from its header alone, before anything is inflated', async () => {
    const bomb = pyZstd('bytes(256 * 2**20)');
    expect(bomb.length).to.be.below(16_384);
    // Ten bytes (magic, descriptor, content size) are enough: the rest is never pushed.
    const z = new ZstdBody(64 * MiB);
    expect(await refusal(() => z.push(bomb.subarray(0, 10)))).to.equal(
      'request body too large: the zstd body inflates past the limit of 67108864 bytes (TB_MAX_TRAIN_BODY_MB)',
    );
    // Frames that each fit but add up past the limit: refused at the frame that passes it.
    const three = pyZstd(`bytes(${MiB})`);
    expect(await refusal(inflateIn(Buffer.concat([three, three, three]), 1, 2.5 * MiB))).to.match(/inflates past the limit of 2621440 bytes/);
    // No declared size: refused once its blocks could hold more than the limit, long before its end.
    const streaming = pyZstd('bytes(256 * 2**20)', { contentSize: false });
    const s = new ZstdBody(64 * MiB);
    let pushed = 0;
    const msg = await refusal(() => {
      for (; pushed < streaming.length; pushed += 64) s.push(streaming.subarray(pushed, pushed + 64));
    });
    expect(msg).to.match(/inflates past the limit of 67108864 bytes/);
    expect(pushed).to.be.below(streaming.length / 2);
  });

  it('refuses a frame that declares less than it holds at its first block past it, without inflating the rest', async () => {
    // 512 MiB of zeros with a 1 KiB window, its content size rewritten to 1 MiB. A decoder that
    // believed the window would inflate all of it before finding the lie at the frame's end.
    const real = pyZstd('bytes(512 * 2**20)', { windowLog: 10 });
    const d = real[4]!;
    expect(d >> 6, 'a 4-byte content size').to.equal(2);
    expect(d & 0x20, 'a window descriptor').to.equal(0);
    const liar = Buffer.from(real);
    liar.writeUInt32LE(MiB, 6);
    const before = process.resourceUsage().maxRSS;
    expect(await refusal(inflateIn(liar, 65_536))).to.match(/^the body is not valid zstd \(Content-Encoding: zstd\): /);
    const grew = (process.resourceUsage().maxRSS - before) / 1024;
    expect(grew, `peak RSS grew ${grew.toFixed(0)} MiB`).to.be.below(64);
  });

  it('refuses what is not zstd, cut short or corrupted, with the reason', async () => {
    const good = pyZstd(plain, { checksum: true });
    const cases: [Buffer, RegExp][] = [
      [randomBytes(4096), /it does not start with a zstd frame$/],
      [good.subarray(0, good.length - 100), /the body ends inside a frame$/],
      [Buffer.concat([good, Buffer.from('trailing')]), /unknown data after frame 1$/],
      [Buffer.from([...good.subarray(0, 4), good[4]! | 0x08, ...good.subarray(5)]), /sets its reserved bit$/],
      [Buffer.from([0x28, 0xb5, 0x2f, 0xfd, 0x01, 0x58, 0x07, 0x01, 0x00, 0x00]), /needs dictionary 7; this server has no zstd dictionaries$/],
      [Buffer.from([0x28, 0xb5, 0x2f, 0xfd, 0x00, 0x58, 0x07, 0x00, 0x00]), /a block has the reserved type 3$/],
      // No content size and a 16 MiB window (exponent 14), then an empty last raw block.
      [Buffer.from([0x28, 0xb5, 0x2f, 0xfd, 0x00, 14 << 3, 0x01, 0x00, 0x00]), /window of 16777216 bytes, over RFC 9659's 8388608$/],
    ];
    // A flipped byte inside the compressed payload: libzstd's own reason (a corrupted block or the checksum).
    const flipped = Buffer.from(good);
    flipped[Math.floor(good.length / 2)]! ^= 0xff;
    cases.push([flipped, /^the body is not valid zstd \(Content-Encoding: zstd\): \S/]);
    for (const [body, pattern] of cases) {
      const msg = await refusal(inflateIn(body, 100));
      expect(msg).to.match(/^the body is not valid zstd \(Content-Encoding: zstd\): /);
      expect(msg).to.match(pattern);
    }
  });

  it('reads Content-Encoding: none, identity or zstd; refuses any other coding', async () => {
    for (const h of [undefined, '', 'identity']) expect(bodyCoding(h)).to.equal('identity');
    for (const h of ['zstd', ' ZSTD ']) expect(bodyCoding(h)).to.equal('zstd');
    expect(await refusal(() => bodyCoding('gzip'))).to.equal("Content-Encoding 'gzip' is not supported here: send the body uncompressed or as zstd");
  });
});

describe('zstd forward_backward bodies through the API', function () {
  this.timeout(300_000);
  let s: TestStack;
  let sessionId: string;
  const LIMIT = 2 * MiB;
  before(async () => {
    s = await startStack({ env: { TB_MAX_TRAIN_BODY_MB: '2' } });
    sessionId = (await call(s.baseUrl, 'POST', '/create_session', { tags: [] })).json.session_id;
  });
  after(async () => s?.stop());

  let modelSeq = 0;
  async function createModel(): Promise<string> {
    const r = await call(s.baseUrl, 'POST', '/create_model', { session_id: sessionId, model_seq_id: modelSeq++, base_model: TINY_MODEL_ALIAS, lora_config: { rank: 2, seed: 0 } });
    await awaitFuture(s.baseUrl, r.json.request_id);
    return r.json.model_id;
  }
  const post = async (body: Buffer, encoding: string | null = 'zstd') => {
    const headers: Record<string, string> = { 'x-api-key': API_KEY, 'content-type': 'application/x-protobuf' };
    if (encoding) headers['content-encoding'] = encoding;
    const res = await fetch(`${s.baseUrl}/api/v1/forward_backward`, { method: 'POST', headers, body: new Uint8Array(body) });
    return { status: res.status, json: (await res.json()) as any };
  };
  const result = async (r: { status: number; json: any }) => {
    expect(r.status, JSON.stringify(r.json)).to.equal(200);
    const f = await awaitFuture(s.baseUrl, r.json.request_id, 'application/x-protobuf');
    expect(f.status).to.equal(200);
    return decodeForwardBackwardOutput(f.body);
  };
  const refused = (r: { status: number; json: any }, pattern: RegExp) => {
    expect(r.status, JSON.stringify(r.json)).to.equal(400);
    expect(r.json).to.include({ category: 'user', code: 'INVALID_REQUEST' });
    expect(r.json.error).to.match(pattern);
  };
  const healthy = async () => {
    const h = await fetch(`${s.baseUrl}/healthz`);
    expect(h.status).to.equal(200);
  };

  /** One datum of 800 tokens with (800, 128) top-K targets and weights: 1.2 MB, past the 1 MiB watch. */
  const wide = (modelId: string, seqId: number, forwardOnly: boolean) => {
    const [n, k] = [800, 128];
    return encodeForwardBackwardMessage({
      model_id: modelId,
      seq_id: seqId,
      loss_fn: 'cross_entropy',
      forward_only: forwardOnly,
      data: [
        {
          model_input: [{ encoded_text: { tokens: i32(Array.from({ length: n }, (_, i) => (i * 13) % 1000)) } }],
          loss_fn_inputs: {
            target_tokens: { dense: i64(Array.from({ length: n * k }, (_, i) => (i * 31) % 1000)), dtype: 2, shape: [n, k] },
            weights: { dense: f32(Array.from({ length: n * k }, (_, i) => ((i % k) + 1) / (k * k))), dtype: 1, shape: [n, k] },
          },
        },
      ],
    });
  };

  it('gives a zstd body the same result as the plain one: small datums, and one past the 1 MiB watch', async () => {
    const id = await createModel();
    const small = (seqId: number) => encodeForwardBackward({ modelId: id, seqId, data: [datum(5), datum(40, 2), datum(300, 9)], forwardOnly: true });
    const a = await result(await post(small(1), null));
    const b = await result(await post(pyZstd(small(2))));
    expect(b.metrics['loss:sum']).to.be.a('number').and.equal(a.metrics['loss:sum']);
    expect(b.logprobs).to.deep.equal(a.logprobs);

    expect(wide(id, 3, true).length).to.be.within(MiB, LIMIT);
    const c = await result(await post(wide(id, 3, true), null));
    const zwide = pyZstd(wide(id, 4, true));
    expect(zwide.length).to.be.below(wide(id, 4, true).length / 4);
    const d = await result(await post(zwide));
    expect(d.metrics['loss:sum']).to.equal(c.metrics['loss:sum']);
    expect(d.logprobs).to.deep.equal(c.logprobs);
    // And it trains: a forward_backward and an optim_step after it.
    expect((await result(await post(pyZstd(wide(id, 5, false))))).metrics['loss:sum']).to.equal(c.metrics['loss:sum']);
    const optim = await call(s.baseUrl, 'POST', '/optim_step', { model_id: id, seq_id: 6, adam_params: { learning_rate: 0.01, beta1: 0.9, beta2: 0.95, eps: 1e-12, weight_decay: 0, grad_clip_norm: 0 } });
    expect((await awaitFuture(s.baseUrl, optim.json.request_id)).json.metrics).to.have.property('grad_norm');
  });

  it('refuses a bomb from its first bytes with a clear error, and the server stays healthy', async () => {
    const id = await createModel();
    const body = encodeForwardBackward({ modelId: id, seqId: 1, data: [datum(5)] });
    // 16 MiB of protobuf padding after the datum: an 8 kB body that inflates past the 2 MiB limit.
    const bomb = pyZstd(Buffer.concat([body, Buffer.alloc(16 * MiB)]));
    expect(bomb.length).to.be.below(8_192);
    // Only its first 64 bytes are sent, and the body is never finished: the answer comes anyway.
    const early = await new Promise<{ status: number; json: any }>((resolve, reject) => {
      const req = http.request(
        `${s.baseUrl}/api/v1/forward_backward`,
        { method: 'POST', headers: { 'x-api-key': API_KEY, 'content-type': 'application/x-protobuf', 'content-encoding': 'zstd', 'content-length': String(bomb.length) } },
        (res) => {
          let text = '';
          res.on('data', (c) => (text += c));
          res.on('end', () => {
            resolve({ status: res.statusCode!, json: JSON.parse(text) });
            req.destroy();
          });
        },
      );
      req.on('error', reject);
      req.write(bomb.subarray(0, 64));
    });
    refused(early, /^request body too large: the zstd body inflates past the limit of 2097152 bytes \(TB_MAX_TRAIN_BODY_MB\)$/);
    refused(await post(bomb), /inflates past the limit of 2097152 bytes/);
    // Without a declared size: refused once its blocks could hold more than the limit.
    refused(await post(pyZstd(Buffer.concat([body, Buffer.alloc(16 * MiB)]), { contentSize: false })), /inflates past the limit of 2097152 bytes/);
    // Declaring 1 MiB, holding 16 MiB: refused at its first block past the declared size.
    const liar = pyZstd(Buffer.concat([body, Buffer.alloc(16 * MiB)]), { windowLog: 10 });
    liar.writeUInt32LE(MiB, 6);
    refused(await post(liar), /^the body is not valid zstd \(Content-Encoding: zstd\): /);
    // A compressed body past the limit is refused as a plain one is.
    refused(await post(randomBytes(3 * MiB)), /^request body too large \(limit 2097152 bytes\)$/);
    await healthy();
    // Nothing was decoded, so seq_id 1 is still the model's next op, and it runs.
    expect((await result(await post(pyZstd(body)))).metrics['loss:sum']).to.be.a('number');
  });

  it('answers a garbled, cut or otherwise coded body with a clear 400', async () => {
    const id = await createModel();
    const body = pyZstd(encodeForwardBackward({ modelId: id, seqId: 1, data: [datum(5)] }), { checksum: true });
    refused(await post(randomBytes(5000)), /^the body is not valid zstd \(Content-Encoding: zstd\): it does not start with a zstd frame$/);
    refused(await post(body.subarray(0, body.length - 3)), /^the body is not valid zstd \(Content-Encoding: zstd\): the body ends inside a frame$/);
    const flipped = Buffer.from(body);
    flipped[body.length - 8]! ^= 0x5a;
    refused(await post(flipped), /^the body is not valid zstd \(Content-Encoding: zstd\): \S/);
    refused(await post(body, 'gzip'), /^Content-Encoding 'gzip' is not supported here/);
    // zstd around something that is not a ForwardBackwardRequest: the route's own words.
    refused(await post(pyZstd(Buffer.from('{"model_id": "x"}'))), /forward_backward body is not a valid ForwardBackwardRequest/);
    await healthy();
    expect((await result(await post(body))).metrics['loss:sum']).to.be.a('number');
  });

  it('holds the inflated body to the datum bounds: the watch past 1 MiB, and the model’s own', async () => {
    const id = await createModel();
    // 400k tokens (1.6 MB inflated, a few kB sent): the watch refuses it and uses up its seq_id.
    const long = Array.from({ length: 400_000 }, (_, i) => i % 1000);
    const hostile = pyZstd(encodeForwardBackward({ modelId: id, seqId: 1, data: [{ tokens: long, targets: [1] }] }));
    expect(hostile.length).to.be.below(64_000);
    refused(await post(hostile), /^forward_backward: data\[0\]: 400000 tokens or more exceed the longest context served here \(2048\)$/);
    // 2049 tokens: past the model's context, refused by the route's decode (seq_id 2 used up too).
    const over = Array.from({ length: 2049 }, (_, i) => i % 1000);
    refused(await post(pyZstd(encodeForwardBackward({ modelId: id, seqId: 2, data: [{ tokens: over, targets: over }] }))), /data\[0\]: 2049 tokens exceed the model's context length of 2048/);
    expect((await result(await post(pyZstd(encodeForwardBackward({ modelId: id, seqId: 3, data: [datum(5)] }))))).metrics['loss:sum']).to.be.a('number');
    await healthy();
  });
});
