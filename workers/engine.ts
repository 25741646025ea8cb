import { spawn, type ChildProcessWithoutNullStreams } from 'node:child_process';
import { EventEmitter } from 'node:events';
import path from 'node:path';
import { fileURLToPath } from 'node:url';
import { BrokerError, engineCode, type ErrorCategory } from '../queues/contract/errors.js';
import { ENGINE_INTERNAL_ENV } from '../queues/infra/config.js';
import type { Logger } from '../queues/infra/logger.js';
import { decodeFrame, encodeFrame } from './engine-frame.js';
import { describeIssues, ENGINE_OPS, type EngineArgs, type EngineOp, type EngineResult } from './engine-protocol.js';

/** An engine's error reply (or a failure of the channel) as a broker error: `user` refused input, `server` a failed engine. */
export class EngineError extends BrokerError {
  override readonly name: string = 'EngineError';
  constructor(category: ErrorCategory, message: string) {
    super(engineCode(category), message);
  }
}

type Pending = { op: EngineOp; resolve: (v: unknown) => void; reject: (e: Error) => void };

export type EngineEvents = { exit: [code: number | null, signal: NodeJS.Signals | null] };

export type EngineOptions = {
  python: string;
  device?: string | undefined;
  log: Logger;
  /** Extra environment for the engine process: its settings (queues/infra/config.ts engineSettingsEnv), its launch's. */
  env?: NodeJS.ProcessEnv;
  /** Arguments after the interpreter. @defaultValue `['-m', 'tinker_engine']` (the torch engine) */
  args?: string[];
};

/** The Python logging level that shows what `log` shows. */
function engineLogLevel(log: Logger): string {
  if (log.isLevelEnabled('debug')) return 'DEBUG';
  if (log.isLevelEnabled('info')) return 'INFO';
  return log.isLevelEnabled('warn') ? 'WARNING' : 'ERROR';
}

const PYTHON_DIR = path.join(path.dirname(fileURLToPath(import.meta.url)), 'python');

/** An engine setting's variable (the engines read no other `TB_` variable, bar TB_LOSS_CATALOGUE, an internal one). */
const ENGINE_SETTING = /^TB_(ENGINE|VERL)_/;

/**
 * The engine process's environment: the agent's, less every engine setting in it but the internal
 * knobs (ENGINE_INTERNAL_ENV), then what the agent decided — the engine logs at the agent's level,
 * then `opts.env` (its settings from the configuration, its launch's variables) and `opts.device`.
 * So the engine sees only settings the agent's configuration parsed, however it was started.
 */
export function engineProcessEnv(agentEnv: NodeJS.ProcessEnv, opts: Pick<EngineOptions, 'device' | 'log' | 'env'>): NodeJS.ProcessEnv {
  const inherited = Object.entries(agentEnv).filter(([name]) => !ENGINE_SETTING.test(name) || ENGINE_INTERNAL_ENV.includes(name));
  return {
    ...Object.fromEntries(inherited),
    // Its line per op (info) is written, and woken for, only when the agent's log shows it.
    TB_ENGINE_LOG_LEVEL: engineLogLevel(opts.log),
    ...opts.env,
    ...(opts.device ? { TB_ENGINE_DEVICE: opts.device } : {}),
    PYTHONPATH: [PYTHON_DIR, agentEnv.PYTHONPATH].filter(Boolean).join(path.delimiter),
    PYTHONUNBUFFERED: '1',
    HF_HUB_OFFLINE: '1',
    TRANSFORMERS_OFFLINE: '1',
  };
}

/**
 * The engine process and the channel to it (docs/engine-protocol.md, protocol 2): frames of JSON
 * plus binary tensors over the child's stdin/stdout, each operation's arguments and result typed
 * and checked by its schema in `workers/engine-protocol.ts`; its stderr is forwarded to the
 * agent's log. Replies are matched to requests by id (sample replies can overtake: the engine runs
 * other ops between decode steps); one failing request does not end the process.
 */
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
    const env = engineProcessEnv(process.env, this.opts);
    const child = spawn(this.opts.python, this.opts.args ?? ['-m', 'tinker_engine'], { env, stdio: ['pipe', 'pipe', 'pipe'] });
    this.child = child;
    child.stdout.on('data', (chunk: Buffer) => this.onData(chunk));
    let errTail = '';
    child.stderr.setEncoding('utf8');
    child.stderr.on('data', (s: string) => {
      errTail += s;
      const lines = errTail.split('\n');
      errTail = lines.pop() ?? '';
      // A line per op at info: not even built into a record when the log is above info.
      if (this.opts.log.isLevelEnabled('info')) for (const line of lines) if (line.trim()) this.opts.log.info(line, { src: 'engine' });
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
      const body = this.buf.subarray(4, 4 + n);
      this.buf = this.buf.subarray(4 + n);
      let msg: { id: number; ok: boolean; result?: unknown; error?: { category?: string; message?: string } };
      try {
        msg = decodeFrame(body) as typeof msg;
      } catch (e) {
        this.opts.log.error('engine sent a malformed frame', { err: (e as Error).message, body: body.toString('utf8', 0, 200) });
        this.child?.kill('SIGKILL');
        return;
      }
      const p = this.pending.get(msg.id);
      if (!p) continue;
      this.pending.delete(msg.id);
      if (!msg.ok) {
        p.reject(new EngineError(msg.error?.category === 'user' ? 'user' : 'server', msg.error?.message ?? 'engine error'));
        continue;
      }
      const parsed = ENGINE_OPS[p.op].result.safeParse(msg.result);
      if (parsed.success) p.resolve(parsed.data);
      else p.reject(new EngineError('server', `the engine returned an invalid ${p.op} result (non-finite values?): ${describeIssues(parsed.error)}`));
    }
  }

  /** Sends one request, its arguments checked by the op's schema; resolves with its parsed result or rejects with an EngineError. */
  call<O extends EngineOp>(op: O, args: EngineArgs<O>): Promise<EngineResult<O>> {
    if (!this.child || this.exited) return Promise.reject(new EngineError('server', `engine process is not running (op ${op})`));
    const checked = ENGINE_OPS[op].args.safeParse(args);
    if (!checked.success) return Promise.reject(new EngineError('server', `the agent built invalid ${op} arguments: ${describeIssues(checked.error)}`));
    const id = this.nextId++;
    const frame = encodeFrame({ id, op, args: checked.data });
    return new Promise<EngineResult<O>>((resolve, reject) => {
      this.pending.set(id, { op, resolve: resolve as (v: unknown) => void, reject });
      this.child!.stdin.write(frame);
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
