import http from 'node:http';
import { EngineError } from '../../engine.js';

export type HttpReply = { status: number; body: unknown };

/**
 * How long an idle keep-alive connection is kept: below the server's, so the client, not the
 * server, closes it. vLLM's API server (uvicorn) closes idle connections after 5 s
 * (`VLLM_HTTP_TIMEOUT_KEEP_ALIVE`, default 5).
 */
export const CLIENT_KEEPALIVE_MS = 4_000;

export type VllmClientOptions = {
  /** @defaultValue CLIENT_KEEPALIVE_MS */
  keepAliveMs?: number;
};

/** A request refused by the peer on a connection it had already used: the server closed it meanwhile. */
class StaleConnection extends Error {
  constructor(readonly original: Error) {
    super(original.message);
  }
}

/**
 * A small JSON client over node:http (keep-alive; no timeout on completions, which may wait in vLLM's queue).
 *
 * A server closes an idle keep-alive connection on its own schedule; a request sent on it at that
 * moment fails with ECONNRESET (or EPIPE) before any answer. Two defences: idle connections are
 * closed here first (`keepAliveMs`), and a request whose reused connection failed before any answer
 * is sent again once, on a new connection. Every request of this client may be repeated: a
 * completion only samples, loading an adapter twice answers "already loaded", unloading it twice 404.
 */
export class VllmClient {
  private readonly agent: http.Agent;
  /** Requests sent again after their reused connection was reset (diagnostics, tests). */
  retried = 0;

  constructor(
    readonly url: string,
    opts: VllmClientOptions = {},
  ) {
    // `timeout` is the idle time after which the agent destroys a free socket.
    this.agent = new http.Agent({ keepAlive: true, maxSockets: 256, timeout: opts.keepAliveMs ?? CLIENT_KEEPALIVE_MS });
  }

  async request(method: 'GET' | 'POST', route: string, body?: unknown, timeoutMs = 0): Promise<HttpReply> {
    const payload = body === undefined ? undefined : Buffer.from(JSON.stringify(body));
    try {
      return await this.send(method, route, payload, timeoutMs, this.agent);
    } catch (e) {
      if (!(e instanceof StaleConnection)) throw e;
      this.retried++;
      // A new connection of its own: another pooled one may be just as stale.
      return this.send(method, route, payload, timeoutMs, false).catch((e2) => {
        throw e2 instanceof StaleConnection ? this.unreachable(route, e2.original) : e2;
      });
    }
  }

  private send(method: 'GET' | 'POST', route: string, payload: Buffer | undefined, timeoutMs: number, agent: http.Agent | false): Promise<HttpReply> {
    const u = new URL(route, this.url);
    return new Promise((resolve, reject) => {
      let answered = false;
      const req = http.request(
        u,
        {
          method,
          agent,
          headers: payload ? { 'content-type': 'application/json', 'content-length': payload.length } : {},
        },
        (res) => {
          answered = true;
          const chunks: Buffer[] = [];
          res.on('data', (c: Buffer) => chunks.push(c));
          res.on('error', (e) => reject(this.unreachable(route, e)));
          res.on('end', () => {
            const text = Buffer.concat(chunks).toString('utf8');
            let parsed: unknown = text;
            if ((res.headers['content-type'] ?? '').includes('json')) {
              try {
                parsed = JSON.parse(text);
              } catch {
                /* keep the text */
              }
            }
            resolve({ status: res.statusCode ?? 0, body: parsed });
          });
        },
      );
      if (timeoutMs) req.setTimeout(timeoutMs, () => req.destroy(new Error(`no answer within ${timeoutMs} ms`)));
      req.on('error', (e) => {
        const code = (e as NodeJS.ErrnoException).code;
        if (req.reusedSocket && !answered && (code === 'ECONNRESET' || code === 'EPIPE')) reject(new StaleConnection(e));
        else reject(this.unreachable(route, e));
      });
      req.end(payload);
    });
  }

  private unreachable(route: string, e: Error): EngineError {
    const code = (e as NodeJS.ErrnoException).code;
    return new EngineError('server', `the vLLM server at ${this.url} is unreachable (${route}: ${code ?? e.message})`);
  }

  close(): void {
    this.agent.destroy();
  }
}
