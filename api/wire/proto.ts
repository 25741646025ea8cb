import path from 'node:path';
import { fileURLToPath } from 'node:url';
import protobuf from 'protobufjs';
import { CUSTOM_LOSS_FN, CUSTOM_LOSS_OPS } from '../../queues/contract/custom-loss.js';
import { invalid } from '../../queues/contract/errors.js';
import type { Datum, ForwardBackwardResult, SampleResult, Tensor } from '../../queues/contract/schemas.js';

/**
 * Protobuf codecs of the Tinker wire format: the forward_backward request body, and the
 * ForwardBackwardOutput / SampleResponse future results. Byte fields are little-endian arrays.
 */
// keepCase: field names exactly as in the .proto (snake_case), as on the wire.
const root = new protobuf.Root().loadSync(path.join(path.dirname(fileURLToPath(import.meta.url)), 'tinker_public.proto'), { keepCase: true });
const ForwardBackwardRequestT = root.lookupType('tinker_public.ForwardBackwardRequest');
const ForwardBackwardOutputT = root.lookupType('tinker_public.ForwardBackwardOutput');
const SampleResponseT = root.lookupType('tinker_public.SampleResponse');

export const PROTOBUF_CONTENT_TYPE = 'application/x-protobuf';

const DTYPE = { UNSPECIFIED: 0, FLOAT32: 1, INT64: 2, INT32: 3, BFLOAT16: 4 } as const;
const ITEMSIZE: Record<number, number> = { [DTYPE.FLOAT32]: 4, [DTYPE.INT64]: 8, [DTYPE.INT32]: 4, [DTYPE.BFLOAT16]: 2 };

type PbObject = Record<string, unknown>;
const toObj = (t: protobuf.Type, m: protobuf.Message) =>
  t.toObject(m, { longs: Number, enums: Number, bytes: Buffer, defaults: true, arrays: true, objects: true, oneofs: true }) as PbObject;

/** Little-endian array bytes → numbers, widening int32/bfloat16 as the SDK does. */
function readArray(buf: Buffer, dtype: number, what: string): number[] {
  const size = ITEMSIZE[dtype];
  if (!size) throw invalid(`${what}: unsupported tensor dtype ${dtype}`);
  if (buf.length % size !== 0) throw invalid(`${what}: ${buf.length} bytes is not a whole number of ${size}-byte elements`);
  const n = buf.length / size;
  const out = new Array<number>(n);
  for (let i = 0; i < n; i++) {
    const o = i * size;
    if (dtype === DTYPE.FLOAT32) out[i] = buf.readFloatLE(o);
    else if (dtype === DTYPE.INT32) out[i] = buf.readInt32LE(o);
    else if (dtype === DTYPE.INT64) {
      const v = buf.readBigInt64LE(o);
      if (v > BigInt(Number.MAX_SAFE_INTEGER) || v < BigInt(Number.MIN_SAFE_INTEGER)) throw invalid(`${what}: int64 value ${v} out of range`);
      out[i] = Number(v);
    } else {
      const tmp = Buffer.alloc(4);
      tmp.writeUInt32LE((buf.readUInt16LE(o) << 16) >>> 0);
      out[i] = tmp.readFloatLE(0);
    }
  }
  return out;
}

/**
 * Bounds a forward_backward request is decoded under, from the model it names: checked on shapes
 * and byte counts *before* any array is allocated, so a tiny request claiming a huge (sparse)
 * tensor costs nothing.
 */
export type DecodeLimits = {
  /** Most tokens in one datum: the model's context length. */
  maxTokens: number;
  /** The model's vocabulary size (the widest a 2-D input may be). */
  vocabSize: number;
  /** Widest 2-D loss input (N, K) accepted, e.g. top-K distillation targets. */
  maxK: number;
  /**
   * Most rank-0 (scalar) loss inputs in one custom-loss request, over all its datums (a per-datum
   * value such as a sequence's advantage); each is one element, so this bounds their total size
   * too. Every other loss takes none, whatever this says: its inputs are per token.
   * @defaultValue `max_scalar_inputs` of queues/contract/custom-loss.json
   */
  scalarInputs?: number;
};

/** The element count of `bytes` of `dtype`, checked to be whole, without reading them. */
function countOf(buf: Buffer, dtype: number, what: string): number {
  const size = ITEMSIZE[dtype];
  if (!size) throw invalid(`${what}: unsupported tensor dtype ${dtype}`);
  if (buf.length % size !== 0) throw invalid(`${what}: ${buf.length} bytes is not a whole number of ${size}-byte elements`);
  return buf.length / size;
}

/** The bounds a request's loss inputs are decoded under: the model's, its loss_fn (for messages), and its rank-0 inputs so far against their cap. */
type InputRules = DecodeLimits & { lossFn: string; scalars: { seen: number; cap: number } };

function decodeTensor(t: PbObject, what: string, rows: number, limits: InputRules): Tensor {
  const dtype = Number(t.dtype ?? 0);
  const wireDtype: Tensor['dtype'] = dtype === DTYPE.INT64 || dtype === DTYPE.INT32 ? 'int64' : 'float32';
  const shape = ((t.shape as number[] | undefined) ?? []).map(Number);
  if (shape.some((d) => !Number.isInteger(d) || d < 0)) throw invalid(`${what}: invalid shape [${shape.join(', ')}]`);
  // Every loss input is (N,) or (N, K) with N the datum's token count: checked before allocating.
  const checkShape = (sh: number[]) => {
    if (sh.length < 1 || sh.length > 2) throw invalid(`${what}: shape [${sh.join(', ')}] must be (N,) or (N, K)`);
    if (sh[0] !== rows) throw invalid(`${what} has shape [${sh.join(', ')}] but model_input has ${rows} tokens`);
    const k = sh[1] ?? 1;
    const maxK = Math.min(limits.maxK, limits.vocabSize);
    if (k > maxK) throw invalid(`${what}: shape [${sh.join(', ')}] is wider than ${maxK} (the largest K accepted for this model)`);
  };
  if (t.encoding === 'sparse_csr') {
    const csr = t.sparse_csr as PbObject;
    if (shape.length !== 2) throw invalid(`${what}: a sparse CSR tensor needs a 2-D shape, got [${shape.join(', ')}]`);
    checkShape(shape);
    const [nrows, cols] = shape as [number, number];
    const nnz = countOf(csr.values as Buffer, dtype, what);
    if (countOf(csr.crow_indices as Buffer, DTYPE.INT64, `${what} crow_indices`) !== nrows + 1 || countOf(csr.col_indices as Buffer, DTYPE.INT64, `${what} col_indices`) !== nnz || nnz > nrows * cols)
      throw invalid(`${what}: inconsistent sparse CSR indices`);
    const values = readArray(csr.values as Buffer, dtype, what);
    const crow = readArray(csr.crow_indices as Buffer, DTYPE.INT64, `${what} crow_indices`);
    const col = readArray(csr.col_indices as Buffer, DTYPE.INT64, `${what} col_indices`);
    if (crow[0] !== 0 || crow[nrows] !== values.length) throw invalid(`${what}: inconsistent sparse CSR indices`);
    const data = new Array<number>(nrows * cols).fill(0);
    for (let r = 0; r < nrows; r++) {
      if (crow[r + 1]! < crow[r]!) throw invalid(`${what}: inconsistent sparse CSR indices`);
      for (let j = crow[r]!; j < crow[r + 1]!; j++) {
        const c = col[j]!;
        if (c < 0 || c >= cols) throw invalid(`${what}: sparse column index ${c} outside [0, ${cols})`);
        data[r * cols + c] = values[j]!;
      }
    }
    return { dtype: wireDtype, shape, data };
  }
  const dense = (t.dense as Buffer | undefined) ?? Buffer.alloc(0);
  const n = countOf(dense, dtype, what);
  // Protobuf cannot tell an absent shape from an empty one, so the SDK's rank-0 tensor (shape [])
  // arrives as one element with no shape, like an unshaped 1-D list. With as many elements as the
  // datum has tokens it is read as (N,); one element otherwise is a scalar. (A one-token datum's one
  // element stays (1,); a custom loss that declares the input rank 0 takes it as a scalar.)
  if (shape.length === 0 && n === 1 && rows !== 1) {
    const { scalars } = limits;
    if (scalars.cap === 0)
      throw invalid(
        `${what} is a rank-0 (scalar) tensor; loss_fn '${limits.lossFn.slice(0, 64)}' takes (N,) or (N, K) inputs with N = the datum's ${rows} tokens (only custom losses take scalars)`,
      );
    if (scalars.seen >= scalars.cap)
      throw invalid(`${what}: more than ${scalars.cap} rank-0 (scalar) loss inputs in one forward_backward request; send fewer datums per request`);
    scalars.seen++;
    return { dtype: wireDtype, shape: [], data: readArray(dense, dtype, what) };
  }
  const finalShape = shape.length ? shape : [n];
  checkShape(finalShape);
  const count = finalShape.reduce((a, b) => a * b, 1);
  if (count !== n) throw invalid(`${what}: shape [${finalShape.join(', ')}] needs ${count} elements, got ${n}`);
  return { dtype: wireDtype, shape: finalShape, data: readArray(dense, dtype, what) };
}

/** One run of a datum's provenance (SDK `PromptProvenanceSpan` / `SampledProvenanceSpan`). */
export type ProvenanceSpan = { kind: 'prompt' | 'sampled'; sequence_id: string; offset: number; length: number };
/** `Datum.with_provenance`: runs tiling the model input and the target tokens; null when absent. */
export type DatumProvenance = { model_input: ProvenanceSpan[]; loss_fn_inputs: ProvenanceSpan[] } | null;

function decodeSpans(spans: PbObject[], what: string): ProvenanceSpan[] {
  return spans.map((s, j) => {
    const kind = s.span === 'prompt_tokens' ? 'prompt' : s.span === 'sampled_tokens' ? 'sampled' : null;
    if (!kind) throw invalid(`${what}[${j}]: a provenance span must be prompt_tokens or sampled_tokens`);
    const body = s[s.span as string] as PbObject;
    const span = { kind, sequence_id: String(body.sequence_id ?? ''), offset: Number(body.offset ?? 0), length: Number(body.length ?? 0) } as const;
    if (!span.sequence_id) throw invalid(`${what}[${j}]: sequence_id is empty`);
    if (!Number.isSafeInteger(span.offset) || span.offset < 0 || !Number.isSafeInteger(span.length) || span.length < 0)
      throw invalid(`${what}[${j}]: offset and length must be non-negative integers`);
    return span;
  });
}

/** A decoded forward_backward request whose data is decoded only once its model's bounds are known. */
export type DecodedForwardBackward = {
  model_id: string;
  seq_id: number;
  loss_fn: string;
  loss_fn_config: Record<string, number | string>;
  forward_only: boolean;
  /** The datums, decoded under the model's bounds (a user error past them, before allocating). */
  data: (limits: DecodeLimits) => Datum[];
  /** Each datum's provenance (stable_reinforce), in data order. */
  provenance: DatumProvenance[];
};

export function decodeForwardBackwardRequest(body: Buffer): DecodedForwardBackward {
  let msg: protobuf.Message;
  try {
    msg = ForwardBackwardRequestT.decode(body);
  } catch {
    // The decoder's own words ("index out of range: 114 + 44 > 127") tell a client nothing: say what the route takes.
    throw invalid(`forward_backward body is not a valid ForwardBackwardRequest: this route takes the Tinker SDK's protobuf body (Content-Type: ${PROTOBUF_CONTENT_TYPE})`);
  }
  const o = toObj(ForwardBackwardRequestT, msg);
  const lossFn = String(o.loss_fn);
  const data = (limits: DecodeLimits) => {
    const cap = lossFn === CUSTOM_LOSS_FN ? (limits.scalarInputs ?? CUSTOM_LOSS_OPS.max_scalar_inputs) : 0;
    const rules: InputRules = { ...limits, lossFn, scalars: { seen: 0, cap } };
    return (o.data as PbObject[]).map((d, i): Datum => {
      const chunks = d.model_input as PbObject[];
      let n = 0;
      for (const chunk of chunks) {
        if (chunk.chunk !== 'encoded_text')
          throw invalid(`data[${i}]: model_input chunk of type '${String(chunk.chunk)}' is not supported (text tokens only)`);
        n += countOf((chunk.encoded_text as PbObject).tokens as Buffer, DTYPE.INT32, `data[${i}].model_input`);
      }
      if (n > limits.maxTokens) throw invalid(`data[${i}]: ${n} tokens exceed the model's context length of ${limits.maxTokens}`);
      const tokens: number[] = [];
      for (const chunk of chunks)
        for (const t of readArray((chunk.encoded_text as PbObject).tokens as Buffer, DTYPE.INT32, `data[${i}].model_input`)) tokens.push(t);
      const inputs: Record<string, Tensor> = {};
      for (const [k, v] of Object.entries(d.loss_fn_inputs as Record<string, PbObject>)) {
        inputs[k] = decodeTensor(v, `data[${i}].loss_fn_inputs.${k}`, n, rules);
      }
      return { tokens, loss_fn_inputs: inputs };
    });
  };
  const provenance = (o.data as PbObject[]).map((d, i): DatumProvenance => {
    const mi = (d.model_input_spans as PbObject[] | undefined) ?? [];
    const li = (d.loss_fn_input_spans as PbObject[] | undefined) ?? [];
    if (mi.length === 0 && li.length === 0) return null;
    return { model_input: decodeSpans(mi, `data[${i}].model_input_spans`), loss_fn_inputs: decodeSpans(li, `data[${i}].loss_fn_input_spans`) };
  });
  // loss_fn_config_v2 (numbers or text) wins over the numeric-only field 5 when present.
  const config: Record<string, number | string> = { ...(o.loss_fn_config as Record<string, number>) };
  for (const [k, v] of Object.entries(o.loss_fn_config_v2 as Record<string, PbObject>)) {
    if (v.value === 'text') config[k] = String(v.text);
    else if (v.value === 'number') config[k] = Number(v.number);
  }
  return {
    model_id: String(o.model_id),
    seq_id: Number(o.seq_id),
    loss_fn: lossFn,
    loss_fn_config: config,
    forward_only: Boolean(o.forward_only),
    data,
    provenance,
  };
}

function le(values: ArrayLike<number>, kind: 'f32' | 'i32' | 'i64'): Buffer {
  const size = kind === 'i64' ? 8 : 4;
  const buf = Buffer.alloc(values.length * size);
  for (let i = 0; i < values.length; i++) {
    const v = values[i]!;
    if (kind === 'f32') buf.writeFloatLE(v, i * 4);
    else if (kind === 'i32') buf.writeInt32LE(v, i * 4);
    else buf.writeBigInt64LE(BigInt(v), i * 8);
  }
  return buf;
}

/** One ArrayRecord with one BatchedTensor per output field, datums concatenated. */
export function encodeForwardBackwardOutput(r: ForwardBackwardResult): Buffer {
  const fields: Record<string, PbObject> = {};
  const names = r.loss_fn_outputs.length ? Object.keys(r.loss_fn_outputs[0]!) : [];
  for (const name of names) {
    const tensors = r.loss_fn_outputs.map((o) => o[name]!);
    const dtype = tensors[0]!.dtype;
    const trailing = tensors[0]!.shape.slice(1);
    const flat: number[] = [];
    const offsets: number[] = [0];
    const itemsize = dtype === 'int64' ? 8 : 4;
    for (const t of tensors) {
      for (const v of t.data) flat.push(v);
      offsets.push(flat.length * itemsize);
    }
    fields[name] = {
      data: le(flat, dtype === 'int64' ? 'i64' : 'f32'),
      offsets: le(offsets, 'i64'),
      dtype: dtype === 'int64' ? DTYPE.INT64 : DTYPE.FLOAT32,
      trailing_shape: trailing,
    };
  }
  const msg = ForwardBackwardOutputT.fromObject({
    loss_fn_output_type: 'ArrayRecord',
    loss_fn_outputs: [{ type_tag: 'ArrayRecord', fields, num_datums: r.loss_fn_outputs.length }],
    metrics: r.metrics,
  });
  return Buffer.from(ForwardBackwardOutputT.encode(msg).finish());
}

const TOPK_EMPTY_ID = 0;
const TOPK_EMPTY_LOGPROB = -99999.0;

function encodeTopk(rows: ([number, number][] | null)[]): PbObject {
  // k ≥ 1 even when every row is empty (a one-token prompt), so the client decodes [None], not None.
  let k = 1;
  for (const r of rows) k = Math.max(k, r?.length ?? 0);
  const ids: number[] = [];
  const lps: number[] = [];
  for (const row of rows) {
    for (let j = 0; j < k; j++) {
      const cell = row?.[j];
      ids.push(cell ? cell[0] : TOPK_EMPTY_ID);
      lps.push(cell ? cell[1] : TOPK_EMPTY_LOGPROB);
    }
  }
  return { token_ids: le(ids, 'i32'), logprobs: le(lps, 'f32'), k, length: rows.length };
}

export function encodeSampleResponse(r: SampleResult): Buffer {
  const obj: PbObject = {
    sequences: r.sequences.map((s) => ({
      stop_reason: s.stop_reason === 'length' ? 1 : 0,
      tokens: le(s.tokens, 'i32'),
      logprobs: le(s.logprobs, 'f32'),
      ...(s.topk_logprobs ? { topk_sampled_logprobs: encodeTopk(s.topk_logprobs) } : {}),
    })),
    prompt_cache_hit_tokens: 0,
  };
  if (r.prompt_logprobs) obj.prompt_logprobs = le(r.prompt_logprobs.map((v) => (v === null ? NaN : v)), 'f32');
  if (r.topk_prompt_logprobs) obj.topk_prompt_logprobs = encodeTopk(r.topk_prompt_logprobs);
  if (r.target_prompt_logprobs)
    obj.target_prompt_logprobs = { dense: le(r.target_prompt_logprobs.data, 'f32'), dtype: DTYPE.FLOAT32, shape: r.target_prompt_logprobs.shape };
  if (r.prompt_alt_tokens)
    obj.prompt_alt_tokens = {
      tokens: { dense: le(r.prompt_alt_tokens.tokens.data, 'i64'), dtype: DTYPE.INT64, shape: r.prompt_alt_tokens.tokens.shape },
      logprobs: { dense: le(r.prompt_alt_tokens.logprobs.data, 'f32'), dtype: DTYPE.FLOAT32, shape: r.prompt_alt_tokens.logprobs.shape },
    };
  return Buffer.from(SampleResponseT.encode(SampleResponseT.fromObject(obj)).finish());
}
