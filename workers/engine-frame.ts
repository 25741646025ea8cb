import { BinTensor, type WireDtype } from './engine-protocol.js';

/**
 * Frames of the engine channel, protocol 2 (docs/engine-protocol.md "Framing"):
 *
 *   u32 BE  L     length of the rest of the frame
 *   u32 BE  J     length of the JSON part
 *   J bytes       UTF-8 JSON (the message; a tensor is {"dtype", "shape", "bin": [offset, nbytes]}),
 *                 padded with spaces so that 4 + J is a multiple of 8
 *   L-4-J bytes   the tensors' raw little-endian bytes, each at an offset that is a multiple of 8
 */

const ITEM: Record<WireDtype, number> = { float32: 4, int32: 4, int64: 8 };

/** Encodes a message; every `BinTensor` in it travels as binary. */
export function encodeFrame(message: unknown): Buffer {
  const parts: Buffer[] = [];
  let size = 0;
  const json = JSON.stringify(message, (_key, value: unknown) => {
    if (!(value instanceof BinTensor)) return value;
    const bytes = Buffer.from(value.data.buffer, value.data.byteOffset, value.data.byteLength);
    const at = size;
    parts.push(bytes);
    size += bytes.length;
    const pad = (8 - (size % 8)) % 8;
    if (pad) {
      parts.push(Buffer.alloc(pad));
      size += pad;
    }
    return { dtype: value.dtype, shape: value.shape, bin: [at, bytes.length] };
  });
  // Spaces after the JSON (still valid JSON) put the tensor bytes at a multiple of 8 from the
  // frame body's start, so the reader can view them aligned.
  const text = Buffer.from(json, 'utf8');
  const body = Buffer.concat([text, Buffer.alloc((8 - ((4 + text.length) % 8)) % 8, ' ')]);
  const head = Buffer.alloc(8);
  head.writeUInt32BE(4 + body.length + size, 0);
  head.writeUInt32BE(body.length, 4);
  return Buffer.concat([head, body, ...parts], 8 + body.length + size);
}

export class FrameError extends Error {}

/**
 * Decodes one frame body (after its length word). A tensor comes back in the Tinker form
 * `{dtype: 'float32' | 'int64', shape, data: number[]}`, ready for the job result schemas.
 */
export function decodeFrame(body: Buffer): unknown {
  if (body.length < 4) throw new FrameError(`a frame of ${body.length} bytes has no JSON length`);
  const j = body.readUInt32BE(0);
  if (4 + j > body.length) throw new FrameError(`the JSON part (${j} bytes) runs past the frame (${body.length} bytes)`);
  const blob = body.subarray(4 + j);
  return JSON.parse(body.toString('utf8', 4, 4 + j), (_key, value: unknown) => {
    if (value === null || typeof value !== 'object' || Array.isArray(value)) return value;
    const v = value as { dtype?: unknown; shape?: unknown; bin?: unknown };
    if (!Array.isArray(v.bin) || typeof v.dtype !== 'string' || !Array.isArray(v.shape)) return value;
    return readTensor(blob, v.dtype, v.shape, v.bin);
  });
}

function readTensor(blob: Buffer, dtype: string, shape: unknown[], bin: unknown[]): unknown {
  if (!(dtype in ITEM)) throw new FrameError(`unknown tensor dtype '${dtype}'`);
  const item = ITEM[dtype as WireDtype];
  const [at, nbytes] = bin;
  const count = shape.reduce<number>((n, d) => n * (Number.isInteger(d) && (d as number) >= 0 ? (d as number) : NaN), 1);
  if (!Number.isInteger(at) || !Number.isInteger(nbytes) || (at as number) < 0 || (at as number) + (nbytes as number) > blob.length)
    throw new FrameError(`tensor bytes [${String(at)}, +${String(nbytes)}) lie outside the frame's ${blob.length} bytes`);
  if (count * item !== nbytes) throw new FrameError(`tensor of shape [${shape.join(', ')}] ${dtype} needs ${count * item} bytes, has ${String(nbytes)}`);
  // Copy: the frame's bytes need not be aligned for a typed-array view.
  const bytes = Uint8Array.prototype.slice.call(blob, at as number, (at as number) + (nbytes as number)).buffer;
  const data =
    dtype === 'float32'
      ? Array.from(new Float32Array(bytes))
      : dtype === 'int32'
        ? Array.from(new Int32Array(bytes))
        : Array.from(new BigInt64Array(bytes), Number);
  return { dtype: dtype === 'float32' ? 'float32' : 'int64', shape, data };
}
