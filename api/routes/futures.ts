import { Router } from 'express';
import { BrokerError } from '../../queues/contract/errors.js';
import { ForwardBackwardResult, ResultSchemas, SampleResult } from '../../queues/contract/schemas.js';
import type { ApiContext } from '../context.js';
import type { DirectRoutes } from '../direct.js';
import { tenantOf } from '../auth.js';
import { parseBody, RetrieveFutureBody } from '../http-schemas.js';
import { encodeForwardBackwardOutput, encodeSampleResponse, PROTOBUF_CONTENT_TYPE } from '../wire/proto.js';

/** retrieve_future: a long-poll on the job behind a request_id. */
export function futureRoutes(ctx: ApiContext, direct: DirectRoutes): Router {
  const r = Router();

  direct.post(r, '/retrieve_future', async (req, res) => {
    const body = parseBody(RetrieveFutureBody, req.body, 'retrieve_future');
    // The tenant guard is the resolver's: a future of another tenant is 'unknown' (as tenants.ts answers).
    const tenant = tenantOf(req);
    // A record this process's agent handed over a moment ago answers at once; any other future is waited for.
    let st = ctx.futures.kept(body.request_id, tenant);
    if (!st) {
      const abort = new AbortController();
      res.on('close', () => abort.abort());
      st = await ctx.futures.retrieve(body.request_id, tenant, ctx.config.longPollMs, abort.signal);
      if (abort.signal.aborted && !res.writable) return;
    }
    switch (st.kind) {
      case 'unknown':
        throw new BrokerError('NOT_FOUND', `unknown or expired future '${body.request_id}'`);
      case 'pending':
        res.json({ type: 'try_again', request_id: body.request_id, queue_state: st.queueState });
        return;
      case 'failed':
        res.json({ error: st.message, category: st.category, code: st.code });
        return;
      case 'done': {
        const wantsProto = (req.header('accept') ?? '').includes(PROTOBUF_CONTENT_TYPE);
        if (st.op === 'forward_backward') {
          const out = ForwardBackwardResult.parse(st.result);
          if (wantsProto) res.type(PROTOBUF_CONTENT_TYPE).send(encodeForwardBackwardOutput(out));
          else res.json({ loss_fn_output_type: 'ArrayRecord', ...out });
        } else if (st.op === 'sample') {
          const out = SampleResult.parse(st.result);
          if (wantsProto) res.type(PROTOBUF_CONTENT_TYPE).send(encodeSampleResponse(out));
          else res.json({ type: 'sample', prompt_cache_hit_tokens: 0, ...out });
        } else {
          const out = ResultSchemas[st.op].parse(st.result) as Record<string, unknown>;
          res.json({ type: st.op, ...withoutNulls(out) });
        }
        return;
      }
    }
  });

  return r;
}

function withoutNulls(o: Record<string, unknown>): Record<string, unknown> {
  return Object.fromEntries(Object.entries(o).filter(([, v]) => v !== null));
}
