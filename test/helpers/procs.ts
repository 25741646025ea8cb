import { spawn, type ChildProcess } from 'node:child_process';
import { randomUUID } from 'node:crypto';
import { mkdirSync, mkdtempSync, rmSync } from 'node:fs';
import os from 'node:os';
import path from 'node:path';
import { Redis } from 'ioredis';
import { buildApp, listen, type BuiltApp } from '../../api/app.js';
import { loadApiConfig } from '../../queues/infra/config.js';
import { defaultPython, ensureTinyModel, TINY_MODEL_ALIAS, TINY_MODEL_DIR } from '../../scripts/stack.js';
import { freePort } from '../e2e/server.js';

/**
 * Separate processes for fault-injection tests (test/reliability.test.ts): a Redis of the test's own
 * (AOF on, restartable on its data directory), worker agents as `workers/main.ts` processes that
 * can be killed, stopped and continued for real, and an API in this process on that Redis.
 */
export const sleep = (ms: number) => new Promise((r) => setTimeout(r, ms));

export async function waitFor<T>(what: string, fn: () => Promise<T | null | undefined | false>, timeoutMs = 60_000, everyMs = 100): Promise<T> {
  const deadline = Date.now() + timeoutMs;
  let last: unknown;
  for (;;) {
    try {
      const v = await fn();
      if (v) return v;
    } catch (e) {
      last = e;
    }
    if (Date.now() > deadline) throw new Error(`timed out waiting for ${what}${last ? ` (last error: ${String(last)})` : ''}`);
    await sleep(everyMs);
  }
}

export class OwnRedis {
  readonly dir = mkdtempSync(path.join(os.tmpdir(), 'tb-redis-'));
  port = 0;
  private child: ChildProcess | null = null;

  get url(): string {
    return `redis://127.0.0.1:${this.port}`;
  }

  async start(): Promise<void> {
    if (!this.port) this.port = await freePort();
    const child = spawn('redis-server', ['--port', String(this.port), '--bind', '127.0.0.1', '--save', '', '--appendonly', 'yes', '--dir', this.dir], { stdio: 'ignore' });
    this.child = child;
    await waitFor('redis to answer', async () => {
      const r = new Redis(this.url, { lazyConnect: true, maxRetriesPerRequest: 0, retryStrategy: () => null });
      try {
        await r.connect();
        return (await r.ping()) === 'PONG';
      } finally {
        r.disconnect();
      }
    });
  }

  /** Stops Redis (SIGTERM: the AOF is flushed, as a graceful restart does). */
  async stop(signal: NodeJS.Signals = 'SIGTERM'): Promise<void> {
    const c = this.child;
    this.child = null;
    if (!c || c.exitCode !== null) return;
    const exited = new Promise((r) => c.once('exit', r));
    c.kill(signal);
    await exited;
  }

  /** Forgets every key (Redis must be stopped): the next start is an empty Redis. */
  wipe(): void {
    rmSync(this.dir, { recursive: true, force: true });
    mkdirSync(this.dir);
  }

  async destroy(): Promise<void> {
    await this.stop('SIGKILL');
    rmSync(this.dir, { recursive: true, force: true });
  }
}

export type AgentProc = { id: string; child: ChildProcess; log: () => string; exited: Promise<number | null> };

export function spawnAgent(env: Record<string, string>): AgentProc {
  ensureTinyModel(defaultPython());
  const child = spawn(process.execPath, ['--import', 'tsx', 'workers/main.ts'], {
    env: { ...process.env, TB_LOG_LEVEL: process.env.TB_LOG_LEVEL ?? 'warn', TB_AGENT_MODELS: `${TINY_MODEL_DIR}=${TINY_MODEL_ALIAS}`, ...env },
    stdio: ['ignore', 'pipe', 'pipe'],
  });
  let log = '';
  child.stdout!.on('data', (d) => (log += d));
  child.stderr!.on('data', (d) => (log += d));
  const exited = new Promise<number | null>((r) => child.once('exit', (code) => r(code)));
  return { id: env.TB_AGENT_ID!, child, log: () => log, exited };
}

/** The engine process of an agent process (its only `tinker_engine` child). */
export async function enginePid(agent: AgentProc): Promise<number> {
  const { execFileSync } = await import('node:child_process');
  return waitFor('the engine process', async () => {
    const out = execFileSync('pgrep', ['-P', String(agent.child.pid), '-f', 'tinker_engine'], { encoding: 'utf8' }).trim();
    return out ? Number(out.split('\n')[0]) : null;
  });
}

export async function stopAgent(a: AgentProc, signal: NodeJS.Signals = 'SIGKILL'): Promise<void> {
  if (a.child.exitCode === null && a.child.signalCode === null) a.child.kill(signal);
  await a.exited;
}

export type Api = { baseUrl: string; built: BuiltApp; stop: () => Promise<void> };

export async function startApi(env: Record<string, string>): Promise<Api> {
  const built = buildApp(loadApiConfig({ TB_API_KEYS: 'tml-test-key', TB_LONG_POLL_MS: '1000', ...env }));
  built.ctx.redis.on('error', () => undefined); // the tests stop Redis on purpose
  const server = await listen(built, 0, '127.0.0.1');
  const port = (server.address() as { port: number }).port;
  return {
    baseUrl: `http://127.0.0.1:${port}`,
    built,
    stop: async () => {
      server.closeAllConnections();
      await new Promise<void>((resolve) => server.close(() => resolve()));
      await built.close();
    },
  };
}

export function stackEnv(redisUrl: string): { prefix: string; storage: string; env: Record<string, string> } {
  const prefix = `rel-${randomUUID().slice(0, 8)}`;
  const storage = mkdtempSync(path.join(os.tmpdir(), 'tb-rel-'));
  return { prefix, storage, env: { REDIS_URL: redisUrl, TB_PREFIX: prefix, TB_STORAGE_DIR: storage } };
}
