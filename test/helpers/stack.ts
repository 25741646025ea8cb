import { randomUUID } from 'node:crypto';
import { mkdtempSync, rmSync } from 'node:fs';
import os from 'node:os';
import path from 'node:path';
import { Queue } from 'bullmq';
import { Redis } from 'ioredis';
import { buildApp, listen, type BuiltApp } from '../../api/app.js';
import { decodeRequestId } from '../../queues/contract/futures.js';
import { Names } from '../../queues/contract/names.js';
import { loadAgentConfig, loadApiConfig } from '../../queues/infra/config.js';
import { Agent } from '../../workers/agent.js';
import { defaultPython, ensureTinyModel, TINY_MODEL_ALIAS, TINY_MODEL_DIR } from '../../scripts/stack.js';

export const REDIS_URL = process.env.REDIS_URL ?? 'redis://127.0.0.1:6379';
export const API_KEY = 'tml-test-key';
/** A second tenant's key, accepted by every test stack. */
export const API_KEY_B = 'tml-test-key-b';

/** A whole stack in this process, isolated by a fresh key prefix: the API on a free port and, optionally, one agent. */
export type TestStack = {
  prefix: string;
  baseUrl: string;
  built: BuiltApp;
  agent: Agent | null;
  storageDir: string;
  stop: () => Promise<void>;
};

export async function startStack(
  opts: { agent?: boolean; longPollMs?: number; redisUrl?: string; env?: Record<string, string> } = {},
): Promise<TestStack> {
  const prefix = `test-${randomUUID().slice(0, 8)}`;
  const storageDir = mkdtempSync(path.join(os.tmpdir(), 'tb-storage-'));
  const env = {
    REDIS_URL: opts.redisUrl ?? REDIS_URL,
    TB_PREFIX: prefix,
    TB_STORAGE_DIR: storageDir,
    TB_API_KEYS: `${API_KEY},${API_KEY_B}`,
    TB_LONG_POLL_MS: String(opts.longPollMs ?? 5_000),
    TB_AGENT_ID: `agent-${prefix}`,
    TB_AGENT_MODELS: `${TINY_MODEL_DIR}=${TINY_MODEL_ALIAS}`,
    TB_SAMPLE_CONCURRENCY: '4',
    ...opts.env,
  };
  let agent: Agent | null = null;
  if (opts.agent !== false) {
    ensureTinyModel(defaultPython());
    agent = new Agent(loadAgentConfig(env));
    await agent.start();
  }
  const built = buildApp(loadApiConfig(env));
  const server = await listen(built, 0, '127.0.0.1');
  const addr = server.address();
  const port = typeof addr === 'object' && addr ? addr.port : 0;
  return {
    prefix,
    baseUrl: `http://127.0.0.1:${port}`,
    built,
    agent,
    storageDir,
    stop: async () => {
      server.closeAllConnections();
      await new Promise<void>((resolve) => server.close(() => resolve()));
      await built.close();
      await agent?.stop();
      if (!opts.redisUrl) await deletePrefix(prefix);
      rmSync(storageDir, { recursive: true, force: true });
    },
  };
}

/**
 * The agent that took each sample request (its BullMQ job's `processedBy`), `?` where none did. The
 * queues it opens stay in `queues`, for the next call; the caller closes them.
 */
export async function takenBy(redis: Redis, prefix: string, requestIds: string[], queues: Map<string, Queue>): Promise<string[]> {
  return Promise.all(
    requestIds.map(async (id) => {
      const ref = decodeRequestId(id)!;
      let q = queues.get(ref.queue);
      if (!q) queues.set(ref.queue, (q = new Queue(ref.queue, { connection: redis, prefix: new Names(prefix).bull })));
      return (await q.getJob(ref.jobId))?.processedBy ?? '?';
    }),
  );
}

/** Removes every Redis key of a test's prefix (registries, gate, BullMQ queues). */
export async function deletePrefix(prefix: string): Promise<void> {
  const r = new Redis(REDIS_URL);
  try {
    let cursor = '0';
    do {
      const [next, keys] = await r.scan(cursor, 'MATCH', `${prefix}*`, 'COUNT', 500);
      cursor = next;
      if (keys.length) await r.del(...keys);
    } while (cursor !== '0');
  } finally {
    r.disconnect();
  }
}

export type HttpReply = { status: number; headers: Headers; json: any; body: Buffer };

/** One HTTP call as the SDK makes it. */
export async function call(
  baseUrl: string,
  method: 'GET' | 'POST' | 'PUT' | 'DELETE',
  route: string,
  body?: unknown,
  opts: { key?: string | null; raw?: Buffer; contentType?: string; accept?: string } = {},
): Promise<HttpReply> {
  const headers: Record<string, string> = {};
  if (opts.key !== null) headers['x-api-key'] = opts.key ?? API_KEY;
  if (opts.accept) headers.accept = opts.accept;
  let payload: BodyInit | undefined;
  if (opts.raw) {
    headers['content-type'] = opts.contentType ?? 'application/x-protobuf';
    payload = new Uint8Array(opts.raw);
  } else if (body !== undefined) {
    headers['content-type'] = opts.contentType ?? 'application/json';
    payload = typeof body === 'string' ? body : JSON.stringify(body);
  }
  const res = await fetch(`${baseUrl}/api/v1${route}`, { method, headers, body: payload });
  const buf = Buffer.from(await res.arrayBuffer());
  let json: any = null;
  if ((res.headers.get('content-type') ?? '').includes('json')) json = JSON.parse(buf.toString('utf8'));
  return { status: res.status, headers: res.headers, json, body: buf };
}

/** Polls a future as the SDK does, again at once on try_again, until it has an answer. */
export async function awaitFuture(baseUrl: string, requestId: string, accept = 'application/json', maxPolls = 40): Promise<HttpReply> {
  for (let i = 0; i < maxPolls; i++) {
    const r = await call(baseUrl, 'POST', '/retrieve_future', { request_id: requestId, allow_metadata_only: true }, { accept });
    if (r.json?.type !== 'try_again') return r;
  }
  throw new Error(`future ${requestId} never finished`);
}
