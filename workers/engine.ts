import { spawn, type ChildProcessWithoutNullStreams } from 'node:child_process';
import { EventEmitter } from 'node:events';
import path from 'node:path';
import { fileURLToPath } from 'node:url';
import { BrokerError, engineCode, type ErrorCategory } from '../queues/errors.js';
import type { Logger } from '../queues/logger.js';

/**
 * The engine process and the channel to it (docs/engine-protocol.md): length-prefixed JSON
 * frames over the child's stdin/stdout; its stderr is forwarded to the agent's log.
 * Replies are matched to requests by id (sample replies can overtake: the engine runs other ops
 * between decode steps); one failing request does not end the process.
 */
/** An engine's error reply (or a failure of the channel) as a broker error: `user` refused input, `server` a failed engine. */
export class EngineError extends BrokerError {
  override readonly name: string = 'EngineError';
  constructor(category: ErrorCategory, message: string) {
    super(engineCode(category), message);
  }
}

type Pending = { op: string; resolve: (v: unknown) => void; reject: (e: Error) => void };

export type EngineEvents = { exit: [code: number | null, signal: NodeJS.Signals | null] };

export type EngineOptions = {
  python: string;
  device?: string | undefined;
  log: Logger;
  /** Extra environment for the engine process. */
  env?: NodeJS.ProcessEnv;
  /** Arguments after the interpreter. @defaultValue `['-m', 'tinker_engine']` (the torch engine) */
  args?: string[];
};

const PYTHON_DIR = path.join(path.dirname(fileURLToPath(import.meta.url)), 'python');

export class EngineProcess extends EventEmitter<EngineEvents> {
  private child: ChildProcessWithoutNullStreams | null = null;
  private nextId = 1;
  private readonly pending = new Map<number, Pending>();
  private buf: Buffer = Buffer.alloc(0);
  private exited = false;

  constructor(private readonly opts: EngineOptions) {
    super();
  }

  get pid(): number | undefined {
    return this.child?.pid;
  }

  start(): void {
    const env: NodeJS.ProcessEnv = {
      ...process.env,
      ...this.opts.env,
      PYTHONPATH: [PYTHON_DIR, process.env.PYTHONPATH].filter(Boolean).join(path.delimiter),
      PYTHONUNBUFFERED: '1',
      HF_HUB_OFFLINE: '1',
      TRANSFORMERS_OFFLINE: '1',
    };
    if (this.opts.device) env.TB_ENGINE_DEVICE = this.opts.device;
    const child = spawn(this.opts.python, this.opts.args ?? ['-m', 'tinker_engine'], { env, stdio: ['pipe', 'pipe', 'pipe'] });
    this.child = child;
    child.stdout.on('data', (chunk: Buffer) => this.onData(chunk));
    let errTail = '';
    child.stderr.setEncoding('utf8');
    child.stderr.on('data', (s: string) => {
      errTail += s;
      const lines = errTail.split('\n');
      errTail = lines.pop() ?? '';
      for (const line of lines) if (line.trim()) this.opts.log.info(line, { src: 'engine' });
    });
    child.on('error', (err) => this.onExit(null, null, err));
    child.on('exit', (code, signal) => this.onExit(code, signal));
  }

  private onExit(code: number | null, signal: NodeJS.Signals | null, err?: Error): void {
    if (this.exited) return;
    this.exited = true;
    const why = err ? `could not start (${err.message})` : `exited (code ${code}, signal ${signal})`;
    for (const [, p] of this.pending) p.reject(new EngineError('server', `engine process ${why} while running ${p.op}`));
    this.pending.clear();
    this.emit('exit', code, signal);
  }

  private onData(chunk: Buffer): void {
    this.buf = this.buf.length ? Buffer.concat([this.buf, chunk]) : chunk;
    while (this.buf.length >= 4) {
      const n = this.buf.readUInt32BE(0);
      if (this.buf.length < 4 + n) break;
      const body = this.buf.subarray(4, 4 + n).toString('utf8');
      this.buf = this.buf.subarray(4 + n);
      let msg: { id: number; ok: boolean; result?: unknown; error?: { category?: string; message?: string } };
      try {
        msg = JSON.parse(body);
      } catch {
        this.opts.log.error('engine sent a malformed frame', { body: body.slice(0, 200) });
        this.child?.kill('SIGKILL');
        return;
      }
      const p = this.pending.get(msg.id);
      if (!p) continue;
      this.pending.delete(msg.id);
      if (msg.ok) p.resolve(msg.result);
      else p.reject(new EngineError(msg.error?.category === 'user' ? 'user' : 'server', msg.error?.message ?? 'engine error'));
    }
  }

  /** Sends one request; resolves with its result or rejects with an EngineError. */
  call<T = unknown>(op: string, args: Record<string, unknown>): Promise<T> {
    if (!this.child || this.exited) return Promise.reject(new EngineError('server', `engine process is not running (op ${op})`));
    const id = this.nextId++;
    const body = Buffer.from(JSON.stringify({ id, op, args }), 'utf8');
    const head = Buffer.alloc(4);
    head.writeUInt32BE(body.length);
    return new Promise<T>((resolve, reject) => {
      this.pending.set(id, { op, resolve: resolve as (v: unknown) => void, reject });
      this.child!.stdin.write(Buffer.concat([head, body]));
    });
  }

  /** Kills the process (SIGKILL works on a stopped or hung one); pending requests fail through the exit. */
  kill(): void {
    if (this.child && !this.exited) this.child.kill('SIGKILL');
  }

  /** Closes the channel (the engine exits on EOF) and kills it if it does not exit in time. */
  async stop(graceMs = 5_000): Promise<void> {
    if (!this.child || this.exited) return;
    const exited = new Promise<void>((resolve) => this.once('exit', () => resolve()));
    this.child.stdin.end();
    const t = setTimeout(() => this.child?.kill('SIGKILL'), graceMs);
    await exited;
    clearTimeout(t);
  }
}
