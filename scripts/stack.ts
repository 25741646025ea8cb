import { spawn, spawnSync, type ChildProcess } from 'node:child_process';
import { existsSync, mkdirSync } from 'node:fs';
import { createServer } from 'node:net';
import path from 'node:path';
import { Redis } from 'ioredis';
import { logger } from '../queues/infra/logger.js';
import { UsageError } from './cli.js';

/**
 * Pieces of the embedded default stack shared by the start command and the tests:
 * Redis when none is running, and the tiny local model.
 */
export const TINY_MODEL_DIR = path.resolve('models/tiny-qwen3');
export const TINY_MODEL_ALIAS = 'tiny-qwen3';
/** The tiny teacher: the tiny model's shape, other weights (seed 1; any `tiny-qwen3-*` directory is generated so). */
export const TINY_TEACHER_DIR = `${TINY_MODEL_DIR}-teacher`;

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
    throw new UsageError(`Redis at ${url} is not reachable and is not local, so it is not started here; start it, or set REDIS_URL or redis.url`);
  mkdirSync(dataDir, { recursive: true });
  const port = u.port || '6379';
  logger.info('starting embedded redis', { port, dir: dataDir });
  const child = spawn(
    'redis-server',
    ['--port', port, '--bind', '127.0.0.1', '--dir', path.resolve(dataDir), '--appendonly', 'yes', '--appendfsync', 'everysec', '--maxmemory-policy', 'noeviction', '--save', ''],
    { stdio: 'ignore' },
  );
  const failed = new Promise<never>((_, reject) => {
    child.once('error', (e) =>
      reject(new UsageError(`could not start redis-server (${e.message}); install Redis (apt-get install redis-server) or set REDIS_URL to a running one`)),
    );
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

/** Fails with the fix when the API's port is taken (before anything slow starts). */
export async function assertPortFree(host: string, port: number): Promise<void> {
  if (port === 0) return;
  await new Promise<void>((resolve, reject) => {
    const srv = createServer();
    srv.once('error', (e: NodeJS.ErrnoException) => {
      if (e.code === 'EADDRINUSE') reject(new UsageError(`port ${port} is in use; set TB_PORT or api.port in the preset`));
      else if (e.code === 'EADDRNOTAVAIL' || e.code === 'ENOTFOUND')
        reject(new UsageError(`cannot listen on ${host}: no such local address; set TB_HOST or api.host in the preset`));
      else if (e.code === 'EACCES') reject(new UsageError(`no permission to listen on port ${port}; use a port above 1023 (TB_PORT or api.port)`));
      else reject(e);
    });
    srv.listen(port, host, () => srv.close(() => resolve()));
  });
}

/** SIGTERM to a child, SIGKILL after `graceMs`; resolves once it has exited. */
export async function stopChild(child: ChildProcess, graceMs: number): Promise<void> {
  if (child.exitCode !== null || child.signalCode !== null) return;
  const exited = new Promise<void>((resolve) => child.once('exit', () => resolve()));
  child.kill('SIGTERM');
  const t = setTimeout(() => child.kill('SIGKILL'), graceMs);
  await exited;
  clearTimeout(t);
}
