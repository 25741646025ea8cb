import { IncomingMessage, type ServerOptions, ServerResponse } from 'node:http';
import type { ErrorRequestHandler, Express, NextFunction, Request, RequestHandler, Response, Router } from 'express';

/**
 * The hot routes of the API, served without Express's router: a training op's submit
 * (forward_backward, optim_step), retrieve_future and asample, the requests a training loop sends for
 * every step. Express walks its layers for each request (the app's, then `/api/v1`'s, then each
 * route module's routes, matching paths as it goes), and a request that comes after an idle spell
 * runs that code cold. Here the route is found once, by method and path, and the same handlers run
 * in the order Express would run them: the app's and `/api/v1`'s middleware in front (`before`,
 * app.ts), then the route's own, which the route module registers on its Router and here in one
 * call (`post`). Errors go to the same error handler. Any other request (another path or method, a
 * query string) goes to Express as before.
 *
 * The server makes its requests and responses with Express's methods from the start
 * (`serverOptions`): Express gives each request its methods by switching the prototypes of Node's
 * objects as it arrives, which puts every property access after it on a slower path (Node's own
 * `res.end` included). What both cost: docs/benchmarks-history.md, 2026-12-03 18:20.
 */
export class DirectRoutes {
  /** The route handlers by path under /api/v1 (POST). */
  private readonly routes = new Map<string, RequestHandler[]>();

  /** A POST route under /api/v1: on the route module's Router, and served directly with the same handlers. */
  post(r: Router, path: string, ...handlers: RequestHandler[]): void {
    r.post(path, ...handlers);
    this.routes.set(path, handlers);
  }

  /** The server's request and response classes: Node's, with `app`'s request and response methods (see above). */
  serverOptions(app: Express): ServerOptions {
    class Request extends IncomingMessage {}
    Object.setPrototypeOf(Request.prototype, app.request);
    class Response extends ServerResponse {}
    Object.setPrototypeOf(Response.prototype, app.response);
    return { IncomingMessage: Request, ServerResponse: Response as unknown as typeof ServerResponse };
  }

  /**
   * The server's request listener: a POST of a direct route runs `before(path)` and the route's
   * handlers, an error `onError`; everything else goes to `app`.
   */
  listener(app: Express, before: (path: string) => RequestHandler[], onError: ErrorRequestHandler): (req: IncomingMessage, res: ServerResponse) => void {
    const chains = new Map<string, RequestHandler[]>();
    for (const [path, handlers] of this.routes) chains.set(`/api/v1${path}`, [...before(path), ...handlers]);
    return (req, res) => {
      const chain = req.method === 'POST' ? chains.get(req.url ?? '') : undefined;
      if (!chain) return void app(req, res);
      run(app, chain, req as Request, res as Response, onError);
    };
  }
}

/** What Express's app.handle does for a request, then its router's walk of one route's handlers. */
function run(app: Express, chain: RequestHandler[], req: Request, res: Response, onError: ErrorRequestHandler): void {
  req.res = res;
  res.req = req;
  // Made by the server with Express's methods (serverOptions); another server's objects get them here.
  if (!Object.prototype.isPrototypeOf.call(app.request, req)) {
    Object.setPrototypeOf(req, app.request);
    Object.setPrototypeOf(res, app.response);
  }
  res.locals ??= Object.create(null);
  req.originalUrl = req.url;
  req.baseUrl = '';
  req.params = {};
  let i = 0;
  let failed = false;
  const fail = (err: unknown) => {
    // One error answer per request, as Express's error handler chain ends it.
    if (failed) return;
    failed = true;
    try {
      onError(err, req, res, () => undefined);
    } catch {
      // What Express's final handler does when the error handler fails: a reply under way is cut.
      if (res.headersSent) req.socket?.destroy();
      else {
        res.statusCode = 500;
        res.end();
      }
    }
  };
  const next: NextFunction = (err?: unknown) => {
    if (err) return fail(err);
    const h = chain[i++];
    // Every route answers: one that passes its request on is a bug of this server.
    if (!h) return fail(new Error(`no handler answered ${req.method} ${req.url}`));
    try {
      const p = h(req, res, next) as unknown;
      // Express 5 passes a handler's rejected promise on as its error.
      if (p && typeof (p as Promise<unknown>).then === 'function') (p as Promise<unknown>).then(undefined, (e: unknown) => next(e ?? new Error('rejected promise')));
    } catch (e) {
      next(e);
    }
  };
  next();
}
