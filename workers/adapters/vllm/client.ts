import http from 'node:http';
import { EngineError } from '../../engine.js';

export type HttpReply = { status: number; body: unknown };

/** A small JSON client over node:http (keep-alive; no timeout on completions, which may wait in vLLM's queue). */
export class VllmClient {
  private readonly agent = new http.Agent({ keepAlive: true, maxSockets: 256 });

  constructor(readonly url: string) {}

  request(method: 'GET' | 'POST', route: string, body?: unknown, timeoutMs = 0): Promise<HttpReply> {
    const u = new URL(route, this.url);
    const payload = body === undefined ? undefined : Buffer.from(JSON.stringify(body));
    return new Promise((resolve, reject) => {
      const req = http.request(
        u,
        {
          method,
          agent: this.agent,
          headers: payload ? { 'content-type': 'application/json', 'content-length': payload.length } : {},
        },
        (res) => {
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
      req.on('error', (e) => reject(this.unreachable(route, e)));
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
