import winston from 'winston';

/**
 * One winston logger for every process, on stderr.
 * - `TB_LOG_FORMAT=json`: one JSON object per line (`timestamp`, `level`, `message` and the ids),
 *   the default under `NODE_ENV=production`; `text` (the default otherwise): a readable line,
 *   `12:00:00.123 info  message key=value …`, coloured on a terminal.
 * - `TB_LOG_LEVEL`: `error`, `warn`, `info` (default) or `debug` (every HTTP request and job).
 * Callers add ids with `logger.child({ requestId, modelId, jobId, queue, op, agentId })`.
 */
const LEVELS = ['error', 'warn', 'info', 'http', 'verbose', 'debug', 'silly'];
const level = process.env.TB_LOG_LEVEL ?? 'info';
const format = process.env.TB_LOG_FORMAT ?? (process.env.NODE_ENV === 'production' ? 'json' : 'text');
const problems: string[] = [];
if (!LEVELS.includes(level)) problems.push(`TB_LOG_LEVEL='${level}' is not a level (error, warn, info, debug); using info`);
if (format !== 'json' && format !== 'text') problems.push(`TB_LOG_FORMAT='${format}' is not json or text; using text`);

const color = process.stderr.isTTY && !process.env.NO_COLOR;
const paint: Record<string, string> = { error: '\x1b[31m', warn: '\x1b[33m', info: '\x1b[36m', debug: '\x1b[2m' };

/** `key=value`, quoting values with spaces; objects as JSON. */
function kv(meta: Record<string, unknown>): string {
  return Object.entries(meta)
    .filter(([, v]) => v !== undefined)
    .map(([k, v]) => {
      const s = typeof v === 'string' ? v : JSON.stringify(v);
      return `${k}=${typeof v === 'string' && /[\s"=]/.test(s) ? JSON.stringify(s) : s}`;
    })
    .join(' ');
}

const threshold = LEVELS.indexOf(LEVELS.includes(level) ? level : 'info');
/** Drops a record below the level before it is formatted (winston formats every record, and only its transport filters by level). */
const enabled = winston.format((info) => (LEVELS.indexOf(info.level) <= threshold ? info : false));

export const logger = winston.createLogger({
  level: LEVELS.includes(level) ? level : 'info',
  format:
    format === 'json'
      ? winston.format.combine(enabled(), winston.format.timestamp(), winston.format.json())
      : winston.format.combine(
          enabled(),
          winston.format.timestamp({ format: 'HH:mm:ss.SSS' }),
          winston.format.printf(({ timestamp, level: lv, message, ...meta }) => {
            const rest = kv(meta);
            const tag = lv.padEnd(5);
            return `${String(timestamp)} ${color ? `${paint[lv] ?? ''}${tag}\x1b[0m` : tag} ${String(message)}${rest ? ` ${color ? `\x1b[2m${rest}\x1b[0m` : rest}` : ''}`;
          }),
        ),
  transports: [new winston.transports.Console({ stderrLevels: LEVELS })],
});
// A record below the level costs nothing: winston's level methods and log() would push it through
// the stream and its formats first, several times per op (docs/benchmarks-history.md, 2026-12-03 07:20).
// Child loggers (Object.create of this one) inherit these.
const winstonProto = Object.getPrototypeOf(logger) as winston.Logger;
const dropped = function (this: winston.Logger) {
  return this;
};
for (const lv of LEVELS.slice(threshold + 1)) Object.assign(logger, { [lv]: dropped });
logger.log = function (this: winston.Logger, ...args: unknown[]) {
  if (typeof args[0] === 'string' && LEVELS.indexOf(args[0]) > threshold) return this;
  return (winstonProto.log as (...a: unknown[]) => winston.Logger).apply(this, args);
} as winston.Logger['log'];
for (const p of problems) logger.warn(p);

export type Logger = winston.Logger;
