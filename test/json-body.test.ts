import http from 'node:http';
import type { AddressInfo } from 'node:net';
import { brotliCompressSync, deflateSync, gzipSync } from 'node:zlib';
import { expect } from 'chai';
import express from 'express';
import { errorHandler } from '../api/errors.js';
import { jsonBody, sendJson } from '../api/json-body.js';

type Reply = { status: number; headers: http.IncomingHttpHeaders; text: string; json: any };

/** One raw request: `body` sent as given, in `chunks` writes when asked (chunked transfer encoding). */
function send(port: number, method: string, headers: Record<string, string | number>, body?: Buffer, chunks = 1): Promise<Reply> {
  return new Promise((resolve, reject) => {
    const req = http.request({ host: '127.0.0.1', port, path: '/echo', method, headers }, (res) => {
      const c: Buffer[] = [];
      res.on('data', (x: Buffer) => c.push(x));
      res.on('end', () => {
        const text = Buffer.concat(c).toString('utf8');
        let json: any;
        try {
          json = JSON.parse(text);
        } catch {
          json = undefined;
        }
        resolve({ status: res.statusCode!, headers: res.headers, text, json });
      });
    });
    req.on('error', reject);
    if (!body) return req.end();
    const step = Math.ceil(body.length / chunks);
    for (let i = 0; i < body.length; i += step) req.write(body.subarray(i, i + step));
    req.end();
  });
}

describe('JSON bodies and answers (api/json-body.ts)', () => {
  let server: http.Server;
  let port: number;
  const LIMIT = 1024;
  before(async () => {
    const app = express();
    app.use(jsonBody(LIMIT));
    app.all('/echo', (req, res) => {
      if (req.headers['x-type']) res.type(String(req.headers['x-type']));
      sendJson(req, res, { body: req.body === undefined ? '<unset>' : req.body });
    });
    app.use(errorHandler);
    server = app.listen(0, '127.0.0.1');
    await new Promise((r) => server.once('listening', r));
    port = (server.address() as AddressInfo).port;
  });
  after(() => server.close());

  const post = (type: string, body: Buffer | string, extra: Record<string, string | number> = {}, chunks = 1) => {
    const b = Buffer.isBuffer(body) ? body : Buffer.from(body);
    const headers: Record<string, string | number> = { 'content-type': type, ...extra };
    if (chunks === 1) headers['content-length'] = b.length;
    return send(port, 'POST', headers, b, chunks);
  };

  it('parses JSON objects and arrays of the JSON types, whole or in chunks, and answers with type and length', async () => {
    const obj = { model_id: 'm', seq_id: 3, nested: { a: [1, 2.5, 'x'] }, unicode: 'é☃' };
    for (const type of ['application/json', 'application/json; charset=utf-8', 'text/json', 'application/vnd.api+json', 'APPLICATION/JSON']) {
      const r = await post(type, JSON.stringify(obj));
      expect(r.status, type).to.equal(200);
      expect(r.json.body).to.deep.equal(obj);
      expect(r.headers['content-type']).to.equal('application/json; charset=utf-8');
      expect(Number(r.headers['content-length'])).to.equal(Buffer.byteLength(r.text));
    }
    const chunked = await post('application/json', JSON.stringify([obj, obj]), {}, 7);
    expect(chunked.status).to.equal(200);
    expect(chunked.json.body).to.deep.equal([obj, obj]);
  });

  it('decodes gzip, deflate and br bodies', async () => {
    const obj = { session_id: 's', tags: ['a', 'b'] };
    const raw = Buffer.from(JSON.stringify(obj));
    for (const [enc, bytes] of [['gzip', gzipSync(raw)], ['deflate', deflateSync(raw)], ['br', brotliCompressSync(raw)]] as const) {
      const r = await post('application/json', bytes, { 'content-encoding': enc });
      expect(r.status, enc).to.equal(200);
      expect(r.json.body).to.deep.equal(obj);
    }
  });

  it('refuses malformed, bare-value, oversized, other-charset and unknown-encoding bodies in the Tinker error shape', async () => {
    const cases: [Promise<Reply>, RegExp][] = [
      [post('application/json', '{"tags": ['), /malformed JSON body/],
      [post('application/json', '3'), /malformed JSON body: expected an object or an array/],
      [post('application/json', '"x"'), /malformed JSON body/],
      [post('application/json', `{"a":"${'x'.repeat(LIMIT)}"}`), /too large \(limit 1024 bytes\)/],
      // Past the limit without a declared length, and past it only once inflated.
      [post('application/json', `{"a":"${'x'.repeat(LIMIT)}"}`, {}, 5), /too large/],
      [post('application/json', gzipSync(Buffer.from(`{"a":"${'x'.repeat(4 * LIMIT)}"}`)), { 'content-encoding': 'gzip' }), /too large/],
      [post('application/json; charset=latin1', '{}'), /unsupported charset 'latin1'/],
      [post('application/json', '{}', { 'content-encoding': 'zstd' }), /unsupported content-encoding 'zstd'/],
      [post('application/json', Buffer.from('not gzip at all'), { 'content-encoding': 'gzip' }), /content-encoding could not be decoded/],
    ];
    for (const [reply, pattern] of cases) {
      const r = await reply;
      expect(r.status, r.text).to.equal(400);
      expect(r.json).to.include({ category: 'user', code: 'INVALID_REQUEST' });
      expect(r.json.error).to.match(pattern);
    }
  });

  it('leaves other types, and requests without a body, unparsed; an empty chunked body is {}', async () => {
    expect((await post('text/plain', '{"a":1}')).json.body).to.equal('<unset>');
    expect((await post('application/x-protobuf', Buffer.from([8, 1]))).json.body).to.equal('<unset>');
    expect((await send(port, 'GET', {})).json.body).to.equal('<unset>');
    expect((await send(port, 'POST', { 'content-type': 'application/json', 'content-length': 0 })).json.body).to.equal('<unset>');
    expect((await post('application/json', '  ', {}, 2)).json.body).to.deep.equal({});
  });

  it("keeps a route's own content type, and sends no body to HEAD", async () => {
    const typed = await send(port, 'GET', { 'x-type': 'application/problem+json' });
    expect(typed.headers['content-type']).to.match(/^application\/problem\+json/);
    expect(typed.json).to.deep.equal({ body: '<unset>' });
    const head = await send(port, 'HEAD', {});
    expect(head.status).to.equal(200);
    expect(head.text).to.equal('');
    expect(Number(head.headers['content-length'])).to.equal(Buffer.byteLength(JSON.stringify({ body: '<unset>' })));
  });
});
