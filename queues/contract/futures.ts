/**
 * Future ids. A `request_id` names the BullMQ queue and job id that hold the operation, so
 * any API process can answer `retrieve_future` from Redis alone: `<queue>/<jobId>`.
 */
export type FutureRef = { queue: string; jobId: string };

export function encodeRequestId(ref: FutureRef): string {
  return `${ref.queue}/${ref.jobId}`;
}

export function decodeRequestId(requestId: string): FutureRef | null {
  const m = /^([a-zA-Z0-9_.-]+)\/([a-zA-Z0-9_.-]+)$/.exec(requestId);
  return m ? { queue: m[1]!, jobId: m[2]! } : null;
}
