import path from 'node:path';
import protobuf from 'protobufjs';

/** Client-side protobuf encoding and decoding, as the SDK does it, for tests that speak the wire directly. */
const root = new protobuf.Root().loadSync(path.resolve('api/wire/tinker_public.proto'), { keepCase: true });
const Req = root.lookupType('tinker_public.ForwardBackwardRequest');
const Out = root.lookupType('tinker_public.ForwardBackwardOutput');
const Sample = root.lookupType('tinker_public.SampleResponse');

const i32 = (a: number[]) => Buffer.from(new Int32Array(a).buffer);
const i64 = (a: number[]) => Buffer.from(new BigInt64Array(a.map(BigInt)).buffer);
const f32 = (a: number[]) => Buffer.from(new Float32Array(a).buffer);

export type TestDatum = { tokens: number[]; targets: number[]; weights?: number[]; advantages?: number[]; logprobs?: number[]; clipHigh?: number[] };

export function encodeForwardBackward(opts: {
  modelId: string;
  seqId: number;
  data: TestDatum[];
  lossFn?: string;
  forwardOnly?: boolean;
  config?: Record<string, number>;
}): Buffer {
  const data = opts.data.map((d) => {
    const inputs: Record<string, object> = {
      target_tokens: { dense: i64(d.targets), dtype: 2, shape: [d.targets.length] },
    };
    const floats: [string, number[] | undefined][] = [
      ['weights', d.weights],
      ['advantages', d.advantages],
      ['logprobs', d.logprobs],
      ['clip_high_threshold', d.clipHigh],
    ];
    for (const [k, v] of floats) if (v) inputs[k] = { dense: f32(v), dtype: 1, shape: [v.length] };
    return { model_input: [{ encoded_text: { tokens: i32(d.tokens) } }], loss_fn_inputs: inputs };
  });
  const msg = Req.fromObject({
    model_id: opts.modelId,
    seq_id: opts.seqId,
    data,
    loss_fn: opts.lossFn ?? 'cross_entropy',
    forward_only: opts.forwardOnly ?? false,
    loss_fn_config: opts.config ?? {},
  });
  return Buffer.from(Req.encode(msg).finish());
}

/** Per-datum `logprobs` and the metrics of a ForwardBackwardOutput. */
export function decodeForwardBackwardOutput(buf: Buffer): { logprobs: number[][]; metrics: Record<string, number> } {
  const o = Out.toObject(Out.decode(buf), { longs: Number, bytes: Buffer }) as any;
  const rec = o.loss_fn_outputs[0];
  const field = rec.fields.logprobs;
  const data = new Float32Array(new Uint8Array(field.data).buffer);
  const offsets = Array.from(new BigInt64Array(new Uint8Array(field.offsets).buffer)).map(Number);
  const logprobs: number[][] = [];
  for (let i = 0; i + 1 < offsets.length; i++) logprobs.push(Array.from(data.slice(offsets[i]! / 4, offsets[i + 1]! / 4)));
  return { logprobs, metrics: o.metrics };
}

export function decodeSampleResponse(buf: Buffer): { sequences: { tokens: number[]; logprobs: number[]; stop_reason: number }[]; promptLogprobs: number[] | null } {
  const o = Sample.toObject(Sample.decode(buf), { longs: Number, bytes: Buffer, defaults: true }) as any;
  return {
    sequences: o.sequences.map((s: any) => ({
      tokens: Array.from(new Int32Array(new Uint8Array(s.tokens).buffer)),
      logprobs: s.logprobs ? Array.from(new Float32Array(new Uint8Array(s.logprobs).buffer)) : [],
      stop_reason: s.stop_reason,
    })),
    promptLogprobs: o.prompt_logprobs?.length ? Array.from(new Float32Array(new Uint8Array(o.prompt_logprobs).buffer)) : null,
  };
}

/** A ForwardBackwardRequest from a plain object (tensors as the proto spells them), for hostile shapes. */
export function encodeForwardBackwardMessage(obj: Record<string, unknown>): Buffer {
  return Buffer.from(Req.encode(Req.fromObject(obj)).finish());
}
export { f32, i32, i64 };
