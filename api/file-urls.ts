import { createHmac, randomBytes, timingSafeEqual } from 'node:crypto';
import { readdir } from 'node:fs/promises';
import path from 'node:path';
import type { Request, RequestHandler } from 'express';
import { z } from 'zod';
import { BrokerError, invalid } from '../queues/contract/errors.js';
import type { ApiContext } from './context.js';

/**
 * Signed download URLs for the files of an external weights checkpoint
 * (`get_external_weights_urls`). A URL names the checkpoint, the file and an expiry, signed with
 * a secret kept in Redis (so every API process accepts every other's URLs); downloading needs no
 * API key, as with a cloud store's signed URL.
 */
export const URL_TTL_MS = 15 * 60 * 1000;

const Token = z.object({ p: z.string(), f: z.string(), e: z.number().int() });

async function secret(ctx: ApiContext): Promise<Buffer> {
  const key = ctx.names.urlSecret();
  await ctx.redis.set(key, randomBytes(32).toString('hex'), 'NX');
  return Buffer.from((await ctx.redis.get(key))!, 'hex');
}

function sign(key: Buffer, payload: string): string {
  return createHmac('sha256', key).update(payload).digest('base64url');
}

/** Every file under `dir`, as paths relative to it. */
export async function listFiles(dir: string): Promise<string[]> {
  const entries = await readdir(dir, { recursive: true, withFileTypes: true });
  return entries
    .filter((e) => e.isFile())
    .map((e) => path.relative(dir, path.join(e.parentPath, e.name)))
    .sort();
}

export async function signedUrls(ctx: ApiContext, req: Request, tinkerPath: string, dir: string): Promise<{ urls: Record<string, string>; expires: string }> {
  const key = await secret(ctx);
  const e = Date.now() + URL_TTL_MS;
  const origin = `${req.protocol}://${req.get('host')}`;
  const urls: Record<string, string> = {};
  for (const f of await listFiles(dir)) {
    const payload = Buffer.from(JSON.stringify({ p: tinkerPath, f, e })).toString('base64url');
    urls[f] = `${origin}/files/${payload}.${sign(key, payload)}`;
  }
  return { urls, expires: new Date(e).toISOString() };
}

/** GET /files/<token>: streams one file of a checkpoint if the token is valid and unexpired. */
export function fileDownloadHandler(ctx: ApiContext): RequestHandler {
  return async (req, res) => {
    const [payload, sig] = String(req.params.token ?? '').split('.');
    const key = await secret(ctx);
    const good = payload && sig ? Buffer.from(sign(key, payload)) : null;
    if (!good || !sig || good.length !== Buffer.from(sig).length || !timingSafeEqual(good, Buffer.from(sig)))
      throw new BrokerError('UNAUTHORIZED', 'invalid download URL signature');
    const t = Token.safeParse(JSON.parse(Buffer.from(payload!, 'base64url').toString('utf8')));
    if (!t.success) throw invalid('malformed download URL');
    if (t.data.e < Date.now()) throw new BrokerError('GONE', 'this download URL has expired; ask for new ones');
    const ckpt = await ctx.registry.checkpoints.get(t.data.p);
    if (!ckpt) throw new BrokerError('NOT_FOUND', `checkpoint ${t.data.p} no longer exists`);
    const file = path.resolve(ckpt.dir, t.data.f);
    if (!file.startsWith(path.resolve(ckpt.dir) + path.sep)) throw invalid('file outside the checkpoint');
    res.sendFile(file);
  };
}
