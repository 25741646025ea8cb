import { spawn, spawnSync, type ChildProcess } from 'node:child_process';
import { existsSync, mkdirSync } from 'node:fs';
import path from 'node:path';
import { Redis } from 'ioredis';
import { logger } from '../queues/logger.js';

/**
 * Pieces of the embedded default stack shared by the start command and the tests:
 * Redis when none is running, and the tiny local model.
 */
export const TINY_MODEL_DIR = path.resolve('models/tiny-qwen3');
export const TINY_MODEL_ALIAS = 'tiny-qwen3';

export async function redisReachable(url: string): Promise<boolean> {
  const r = new Redis(url, { lazyConnect: true, maxRetriesPerRequest: 0, retryStrategy: () => null, connectTimeout: 1000 });
  r.on('error', () => undefined);
  try {
    await r.connect();
    return (await r.ping()) === 'PONG';
  } catch {
    return false;
  } finally {
    r.disconnect();
  }
}

/** Starts `redis-server` for a local URL when nothing answers there; returns the child, if any. */
export async function ensureRedis(url: string, dataDir = 'var/redis'): Promise<ChildProcess | null> {
  if (await redisReachable(url)) return null;
  const u = new URL(url);
  if (!['127.0.0.1', 'localhost', '::1'].includes(u.hostname))
    throw new Error(`Redis at ${url} is not reachable, and it is not local, so it cannot be started here`);
  mkdirSync(dataDir, { recursive: true });
  const port = u.port || '6379';
  logger.info('starting embedded redis', { port, dir: dataDir });
  const child = spawn(
    'redis-server',
    ['--port', port, '--bind', '127.0.0.1', '--dir', path.resolve(dataDir), '--appendonly', 'yes', '--appendfsync', 'everysec', '--maxmemory-policy', 'noeviction', '--save', ''],
    { stdio: 'ignore' },
  );
  const failed = new Promise<never>((_, reject) => {
    child.once('error', (e) => reject(new Error(`could not start redis-server (${e.message}); install Redis or set REDIS_URL`)));
    child.once('exit', (code) => reject(new Error(`redis-server exited with code ${code}`)));
  });
  const deadline = Date.now() + 10_000;
  while (Date.now() < deadline) {
    if (await Promise.race([redisReachable(url), failed])) return child;
    await new Promise((r) => setTimeout(r, 100));
  }
  child.kill();
  throw new Error('redis-server did not answer within 10 s');
}

/**
 * Generates a tiny model (deterministic, a few seconds); seed 1 makes the tiny teacher. The
 * script returns at once when the directory is complete for the current generator version.
 */
export function ensureTinyModel(python: string, dir = TINY_MODEL_DIR, seed = 0): void {
  const r = spawnSync(python, ['scripts/make_tiny_model.py', '--out', dir, '--seed', String(seed)], { stdio: 'inherit' });
  if (r.status !== 0) throw new Error(`scripts/make_tiny_model.py failed (exit ${r.status})`);
}

export function defaultPython(): string {
  const venv = path.resolve('.venv/bin/python');
  return existsSync(venv) ? venv : 'python3';
}
