import winston from 'winston';

/**
 * One winston logger for every process. JSON lines when `TB_LOG_FORMAT=json` (the default
 * under `NODE_ENV=production`), a readable single line otherwise. Callers add ids with
 * `logger.child({ modelId, jobId, queue, agentId, requestId })`.
 */
const json = (process.env.TB_LOG_FORMAT ?? (process.env.NODE_ENV === 'production' ? 'json' : 'text')) === 'json';

export const logger = winston.createLogger({
  level: process.env.TB_LOG_LEVEL ?? 'info',
  format: json
    ? winston.format.combine(winston.format.timestamp(), winston.format.json())
    : winston.format.combine(
        winston.format.timestamp({ format: 'HH:mm:ss.SSS' }),
        winston.format.printf(({ timestamp, level, message, ...meta }) => {
          const rest = Object.keys(meta).length ? ' ' + JSON.stringify(meta) : '';
          return `${String(timestamp)} ${level} ${String(message)}${rest}`;
        }),
      ),
  transports: [new winston.transports.Console({ stderrLevels: ['error', 'warn', 'info', 'debug'] })],
});

export type Logger = winston.Logger;
