import type { Request, RequestHandler, Response } from 'express';
import { createBrotliDecompress, createGunzip, createInflate } from 'node:zlib';
import type { Readable } from 'node:stream';
import { BrokerError, invalid } from '../queues/contract/errors.js';
import { bodyTooLarge } from './errors.js';

/**
 * JSON in and out of every route, on the path of each request: Express's body parser and res.json
 * do what a JSON API needs plus per-request work it does not (charset tables, a stream decoder,
 * freshness checks against an ETag this API never sends). What that cost:
 * docs/benchmarks-history.md, 2026-12-03 12:30.
 */

/** `application/json`, `text/json` or any `+json` type (parameters aside). */
const JSON_TYPE = /^(?:application\/(?:[\w.+-]+\+)?json|text\/json)\s*(?:;|$)/i;

/**
 * Reads a JSON request body into `req.body` (a body that is not JSON, or no body, leaves it
 * unset): UTF-8, gzip, deflate or br encoded, at most `limitBytes` once decoded. A malformed body,
 * one past the limit, another charset or another encoding is refused in the Tinker error shape.
 * As express.json: only an object or an array at the top (a bare value is malformed), an empty
 * body is `{}`.
 */
export function jsonBody(limitBytes: number): RequestHandler {
  return (req, _res, next) => {
    const type = req.headers['content-type'];
    // A body another reader took (api/train-body.ts marks it as body-parser does) is left alone.
    if ((req as { _body?: boolean })._body || !type || !JSON_TYPE.test(type) || !hasBody(req)) return next();
    const charset = /;\s*charset\s*=\s*"?([\w-]+)"?/i.exec(type)?.[1]?.toLowerCase();
    if (charset && charset !== 'utf-8' && charset !== 'utf8') return refuse(req, next, invalid(`unsupported charset '${charset}' of a JSON body: send UTF-8`));
    const declared = Number(req.headers['content-length']);
    if (Number.isFinite(declared) && declared > limitBytes) return refuse(req, next, bodyTooLarge(limitBytes));
    let stream: Readable;
    try {
      stream = decoded(req);
    } catch (e) {
      return refuse(req, next, e);
    }
    const chunks: Buffer[] = [];
    let size = 0;
    let done = false;
    const finish = (err: unknown) => {
      if (done) return;
      done = true;
      stream.removeAllListeners('data');
      if (err) {
        chunks.length = 0;
        return refuse(req, next, err);
      }
      const text = Buffer.concat(chunks, size).toString('utf8');
      if (text.trim() === '') {
        req.body = {};
        return next();
      }
      try {
        // Strict, as express.json: the SDK sends objects; a bare value at the top is a mistake.
        if (!/^\s*[{[]/.test(text)) throw new SyntaxError(`expected an object or an array, got '${text.trim().slice(0, 20)}'`);
        req.body = JSON.parse(text);
        (req as { _body?: boolean })._body = true;
      } catch (e) {
        return next(invalid(`malformed JSON body: ${(e as Error).message}`));
      }
      next();
    };
    stream.on('data', (c: Buffer) => {
      size += c.length;
      if (size > limitBytes) return finish(bodyTooLarge(limitBytes));
      chunks.push(c);
    });
    stream.on('end', () => finish(null));
    stream.on('error', (e: Error) => finish(stream === req ? e : invalid(`the body's content-encoding could not be decoded: ${e.message}`)));
  };
}

/** A request with a body: a length or a transfer encoding (as body-parser decides). */
function hasBody(req: Request): boolean {
  return req.headers['transfer-encoding'] !== undefined || (req.headers['content-length'] !== undefined && req.headers['content-length'] !== '0');
}

function decoded(req: Request): Readable {
  const enc = (req.headers['content-encoding'] ?? 'identity').toLowerCase();
  if (enc === 'identity') return req;
  const d = enc === 'gzip' ? createGunzip() : enc === 'deflate' ? createInflate() : enc === 'br' ? createBrotliDecompress() : null;
  if (!d) throw new BrokerError('INVALID_REQUEST', `unsupported content-encoding '${enc}' of a JSON body (identity, gzip, deflate or br)`);
  req.on('error', (e) => d.destroy(e));
  return req.pipe(d);
}

/** Refuses with `err` once the rest of the body has been read and dropped (the reply is not cut short). */
function refuse(req: Request, next: (err?: unknown) => void, err: unknown): void {
  req.unpipe();
  req.resume();
  next(err);
}

/**
 * Writes `body` as the JSON answer: `application/json; charset=utf-8` (unless the route set a
 * type), its length, the status the route set. What Express's res.json sends here, without its
 * per-answer work.
 */
export function sendJson(req: Request, res: Response, body: unknown): Response {
  const text = JSON.stringify(body) ?? '';
  if (!res.getHeader('content-type')) res.setHeader('content-type', 'application/json; charset=utf-8');
  res.setHeader('content-length', Buffer.byteLength(text));
  res.end(req.method === 'HEAD' ? undefined : text);
  return res;
}
