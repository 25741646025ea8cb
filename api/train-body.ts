import type { RequestHandler } from 'express';
import { invalid } from '../queues/contract/errors.js';
import type { ApiContext } from './context.js';
import { bodyTooLarge } from './errors.js';
import { MAX_TARGET_K, useUpSeqId } from './services/training.js';
import { ForwardBackwardScan, type ScanLimits } from './wire/fb-scan.js';
import { bodyCoding, ZstdBody } from './wire/zstd.js';

/** Bytes of one loss-input element at most (int64 / float64). */
const MAX_ELEMENT_BYTES = 8;
/**
 * Bodies are watched once they pass this size: below it buffering costs nothing worth saving, and
 * the route refuses with the model's own bounds (and messages).
 */
const WATCH_FROM_BYTES = 2 ** 20;

/**
 * Reads a forward_backward body (protobuf) for the route; past 1 MiB it watches the body while it
 * arrives (wire/fb-scan.ts): a datum with more tokens than the longest context served here, or a loss input
 * larger than any served model accepts, is refused after its first bytes, and the rest of the body
 * is read and dropped (never kept, never copied into one buffer). The route then finds `req.body`
 * already read (body-parser leaves a request with `_body` set alone) and decodes it under the
 * model's exact bounds. Past `TB_MAX_TRAIN_BODY_MB` the body is refused as body-parser would.
 *
 * A zstd body (`Content-Encoding: zstd`, the SDK's `proto_compress_fwdbwd`) is inflated once it
 * has arrived (wire/zstd.ts), and every bound above applies to the inflated body: the limit (a body
 * whose frame headers allow more is refused from its first bytes, before anything is inflated), the watch
 * from 1 MiB and the datum bounds. The compressed body is held to the limit too.
 *
 * A refusal uses up the request's seq_id in the model's gate, as the route's own refusals do
 * (services/training.ts useUpSeqId: the SDK never resends a refused seq_id), when the model_id and
 * seq_id came before the datums (the SDK writes them first) and the caller owns the model.
 */
export function forwardBackwardBody(ctx: ApiContext): RequestHandler {
  const limit = (ctx.config.maxTrainBodyMb ?? 64) * 2 ** 20;
  // The served models' bounds, read from Redis at most every 2 s (they change when agents come and go).
  let cached: { at: number; limits: Promise<ScanLimits> } | null = null;
  const limits = (): Promise<ScanLimits> => {
    if (!cached || Date.now() - cached.at > 2_000) {
      const p = servedLimits(ctx);
      cached = { at: Date.now(), limits: p };
      p.catch(() => (cached = null));
    }
    return cached.limits;
  };
  return (req, _res, next) => {
    const declared = Number(req.headers['content-length']);
    if (Number.isFinite(declared) && declared > limit) return next(bodyTooLarge(limit));
    let coding: 'identity' | 'zstd';
    try {
      coding = bodyCoding(req.headers['content-encoding']);
    } catch (e) {
      return next(e);
    }
    const chunks: Buffer[] = [];
    let size = 0;
    let scan: ForwardBackwardScan | null = null;
    let scanned = 0; // chunks already fed to the scan
    let watching: Promise<void> | null = null;
    let done = false;
    const stopReading = () => {
      done = true;
      req.removeListener('data', onBody);
      req.removeListener('end', onBodyEnd);
      chunks.length = 0;
      req.resume(); // the rest is read and dropped; the reply goes out now
    };
    const fail = (err: unknown) => {
      if (done) return;
      stopReading();
      next(err);
    };
    const feed = () => {
      while (scan && !done && scanned < chunks.length) {
        const refusal = scan.push(chunks[scanned++]!);
        if (!refusal) continue;
        const { modelId, seqId } = scan;
        stopReading();
        void useUpSeqId(ctx, req, modelId, seqId).then(
          () => next(invalid(`forward_backward: ${refusal.message}`)),
          (e) => next(e),
        );
      }
    };
    const onData = (chunk: Buffer) => {
      size += chunk.length;
      if (size > limit) return fail(bodyTooLarge(limit));
      chunks.push(chunk);
      if (!watching && size > WATCH_FROM_BYTES) {
        watching = limits().then((l) => {
          if (done) return;
          scan = new ForwardBackwardScan(l);
          feed();
        }, fail);
      }
      feed();
    };
    const onEnd = () => {
      // A watched body that arrived before the bounds were known is scanned before it goes on.
      if (watching && !scan) return void watching.then(onEnd);
      if (done) return;
      done = true;
      req.removeListener('error', fail);
      (req as { _body?: boolean })._body = true;
      req.body = chunks.length === 1 ? chunks[0]! : Buffer.concat(chunks, size);
      next();
    };
    // The body as sent: plain, or zstd, inflated once it has arrived (wire/zstd.ts: what its frame
    // headers allow must be within the limit) and read on from there as a plain body.
    const zstd = coding === 'zstd' ? new ZstdBody(limit) : null;
    const onBody = !zstd
      ? onData
      : (chunk: Buffer) => {
          if (zstd.size + chunk.length > limit) return fail(bodyTooLarge(limit));
          try {
            zstd.push(chunk);
          } catch (e) {
            fail(e);
          }
        };
    const onBodyEnd = !zstd
      ? onEnd
      : () => {
          zstd.inflate().then((plain) => {
            if (done) return;
            onData(plain);
            onEnd();
          }, fail);
        };
    req.on('data', onBody);
    req.on('end', onBodyEnd);
    req.on('error', fail);
  };
}

/** The largest context and loss input any served model accepts (no agent: no early refusal). */
async function servedLimits(ctx: ApiContext): Promise<ScanLimits> {
  let maxTokens = 0;
  for (const { model } of (await ctx.registry.agents.servedModels()).values()) maxTokens = Math.max(maxTokens, model.max_context_length);
  if (maxTokens === 0) return { maxTokens: Infinity, maxTensorBytes: Infinity };
  return { maxTokens, maxTensorBytes: maxTokens * MAX_TARGET_K * MAX_ELEMENT_BYTES };
}

