import { spawn, spawnSync, type ChildProcess } from 'node:child_process';
import { randomUUID } from 'node:crypto';
import { mkdtempSync, rmSync } from 'node:fs';
import { createServer } from 'node:net';
import os from 'node:os';
import path from 'node:path';
import { deletePrefix, REDIS_URL } from '../helpers/stack.js';
import { TINY_MODEL_ALIAS } from '../../scripts/stack.js';

/**
 * The server as a user starts it (`tinker-broker start`, what `npm start` runs), isolated by a
 * fresh key prefix, port and storage directory; and a runner for the SDK scripts in test/e2e.
 */
export const PYTHON = path.resolve('.venv/bin/python');
export const E2E_KEY = 'tml-e2e-key';

export async function freePort(): Promise<number> {
  return new Promise((resolve) => {
    const srv = createServer();
    srv.listen(0, '127.0.0.1', () => {
      const port = (srv.address() as { port: number }).port;
      srv.close(() => resolve(port));
    });
  });
}

export class E2EServer {
  readonly prefix = `e2e-${randomUUID().slice(0, 8)}`;
  readonly storage = mkdtempSync(path.join(os.tmpdir(), 'tb-e2e-'));
  baseUrl = '';
  log = '';
  private child: ChildProcess | null = null;
  private port = 0;

  /** The start command's process id (the API and the agent run in it; the engine is its child), while it runs. */
  get pid(): number | undefined {
    return this.child?.pid;
  }

  /** `extraEnv` overrides the preset (e.g. TB_AGENT_MODELS); `args` go to `tinker-broker start` (e.g. ['--preset', file]). */
  constructor(
    private readonly extraEnv: NodeJS.ProcessEnv = {},
    private readonly args: string[] = [],
  ) {}

  /** Starts the stack (or restarts it on the same port, prefix and storage) and waits for /healthz ready. */
  async start(timeoutMs = 170_000): Promise<void> {
    if (!this.port) this.port = await freePort();
    this.baseUrl = `http://127.0.0.1:${this.port}`;
    // E2E_NODE_ARGS: extra node flags for the start command (e.g. `--cpu-prof --cpu-prof-dir=/tmp/prof` to profile it under a bench).
    const nodeArgs = (process.env.E2E_NODE_ARGS ?? '').split(' ').filter(Boolean);
    const child = spawn(process.execPath, [...nodeArgs, '--import', 'tsx', 'scripts/tinker-broker.ts', 'start', ...this.args], {
      env: {
        ...process.env,
        TB_LOG_LEVEL: process.env.TB_LOG_LEVEL ?? 'warn',
        TB_PORT: String(this.port),
        TB_PREFIX: this.prefix,
        TB_STORAGE_DIR: this.storage,
        TB_API_KEYS: E2E_KEY,
        TB_AGENT_ID: `agent-${this.prefix}`,
        REDIS_URL,
        ...this.extraEnv,
      },
      stdio: ['ignore', 'pipe', 'pipe'],
    });
    this.child = child;
    child.stdout!.on('data', (d) => (this.log += d));
    child.stderr!.on('data', (d) => (this.log += d));
    const deadline = Date.now() + timeoutMs;
    for (;;) {
      if (child.exitCode !== null) throw new Error(`start command exited early:\n${this.log}`);
      try {
        const r = await fetch(`${this.baseUrl}/api/v1/healthz`);
        if (r.status === 200 && (await r.json()).status === 'ready') return;
      } catch {
        /* not listening yet */
      }
      if (Date.now() > deadline) throw new Error(`server not ready:\n${this.log}`);
      await new Promise((r) => setTimeout(r, 250));
    }
  }

  /**
   * Kills the start command's process and its engine with `signal` at once, as a crashed node loses
   * them (no drain, no stop hooks); Redis keys and storage stay. `start()` brings it back on the same
   * port, prefix and storage.
   */
  async kill(signal: NodeJS.Signals = 'SIGKILL'): Promise<void> {
    const c = this.child;
    this.child = null;
    if (!c || c.exitCode !== null) return;
    const kids = spawnSync('pgrep', ['-P', String(c.pid)], { encoding: 'utf8' }).stdout.split('\n').filter(Boolean).map(Number);
    const exited = new Promise((r) => c.once('exit', r));
    c.kill(signal);
    for (const pid of kids) {
      try {
        process.kill(pid, signal);
      } catch {
        /* already gone */
      }
    }
    await exited;
  }

  /** Stops the processes (SIGTERM, as a user's Ctrl-C); Redis keys and storage stay. */
  async stop(): Promise<void> {
    const c = this.child;
    this.child = null;
    if (c && c.exitCode === null) {
      const exited = new Promise((r) => c.once('exit', r));
      c.kill('SIGTERM');
      await exited;
    }
  }

  /** Stops the stack and removes everything it left. */
  async destroy(): Promise<void> {
    await this.stop();
    await deletePrefix(this.prefix);
    rmSync(this.storage, { recursive: true, force: true });
  }

  /** Runs a Python SDK script against this server; returns the JSON object on its last stdout line. */
  runPython(args: string[], timeoutMs = 600_000): any {
    const r = spawnSync(PYTHON, args, {
      env: { ...process.env, TINKER_BASE_URL: this.baseUrl, TINKER_API_KEY: E2E_KEY, HF_HUB_OFFLINE: '1' },
      encoding: 'utf8',
      timeout: timeoutMs,
    });
    if (r.status !== 0) throw new Error(`${args.join(' ')} failed (${r.status}):\n${r.stderr}\n--- server ---\n${this.log.slice(-4000)}`);
    const lines = r.stdout.trim().split('\n');
    return JSON.parse(lines[lines.length - 1]!);
  }
}

/**
 * Inside a `describe`: a fresh server for the suite that runs one SDK script against the tiny model
 * before the tests and is destroyed after them. `output()` is the script's JSON result.
 */
export function suiteRunningScript(script: string): { server: E2EServer; output: () => any } {
  const server = new E2EServer();
  let out: any;
  before(async function () {
    this.timeout(300_000);
    await server.start();
    out = server.runPython([script, TINY_MODEL_ALIAS]);
  });
  after(async () => server.destroy());
  return { server, output: () => out };
}
