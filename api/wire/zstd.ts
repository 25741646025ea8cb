import { Decoder } from '@toondepauw/node-zstd';
import { BrokerError, invalid } from '../../queues/contract/errors.js';

/**
 * A zstd-compressed request body (`Content-Encoding: zstd`, RFC 8878): the SDK compresses
 * forward_backward bodies this way when `/client/config` says `proto_compress_fwdbwd` (one frame,
 * written by python-zstandard's `ZstdCompressor().compress`, which declares the frame's content size).
 *
 * The body never inflates past the limit, and a body that could is refused before anything is
 * inflated. While the compressed bytes arrive, their frame and block headers are read (`FrameWalk`;
 * the payloads are skipped, never read), and each frame gets a bound on what it inflates to:
 * - a frame that declares its content size inflates to exactly that. It is decoded as one segment
 *   of that size (its header rewritten so: its window becomes the whole content, which changes
 *   nothing for a true frame), so libzstd's output buffer is the declared size and a frame that
 *   lies is refused at the first block past it;
 * - a frame that does not declare it (a streaming compressor's) inflates to at most what its
 *   blocks can hold (each regenerates at most min(window, 128 KiB), a limit libzstd enforces), and
 *   its window must be within RFC 9659's 8 MiB.
 * The bounds must add up to the limit at most: a bomb is refused at the header or block that passes
 * it. A frame that needs a dictionary, a reserved block type or a block past the format's size is
 * refused too. Once the body has arrived, libzstd inflates it (the Rust `zstd` crate through
 * @toondepauw/node-zstd, off the event loop). Anything malformed is a 400 that says the body is not
 * valid zstd.
 */

/** RFC 8878: a block regenerates at most 128 KiB. */
const MAX_BLOCK_BYTES = 128 * 2 ** 10;
/** RFC 9659: a zstd content coding's window is at most 8 MB; decoders may refuse more. */
export const MAX_WINDOW_BYTES = 8 * 2 ** 20;
const ZSTD_MAGIC = 0xfd2fb528;
/** Skippable frames: magic 0x184D2A50 to 0x184D2A5F, a 4-byte size, then that many bytes. */
const isSkippableMagic = (m: number) => m >>> 4 === 0x184d2a5;
const SINGLE_SEGMENT = 0x20;

const decoder = new Decoder();

/** The refusal of a body that inflates (or may inflate) past `limit`. */
export function inflatesTooLarge(limit: number): BrokerError {
  return invalid(`request body too large: the zstd body inflates past the limit of ${limit} bytes (TB_MAX_TRAIN_BODY_MB)`);
}

const notZstd = (why: string): BrokerError => invalid(`the body is not valid zstd (Content-Encoding: zstd): ${why}`);

/**
 * The coding of a request body from its `Content-Encoding`: none (or `identity`), or `zstd`.
 * Any other coding is refused: the server could not read the body.
 */
export function bodyCoding(header: string | undefined): 'identity' | 'zstd' {
  const coding = (header ?? '').trim().toLowerCase();
  if (coding === '' || coding === 'identity') return 'identity';
  if (coding === 'zstd') return 'zstd';
  throw invalid(`Content-Encoding '${header}' is not supported here: send the body uncompressed or as zstd`);
}

/** A zstd body while it arrives, inflated once it has. */
export class ZstdBody {
  private readonly walk: FrameWalk;
  private readonly parts: Buffer[] = [];
  private received = 0;

  constructor(maxBytes: number) {
    this.walk = new FrameWalk(maxBytes);
  }

  /** Compressed bytes so far. */
  get size(): number {
    return this.received;
  }

  /** The next piece of the compressed body; throws (400) at the first header refused. */
  push(chunk: Buffer): void {
    this.walk.push(chunk);
    this.parts.push(chunk);
    this.received += chunk.length;
  }

  /** The inflated body; rejects (400) a body cut short or not valid zstd. */
  async inflate(): Promise<Buffer> {
    this.walk.end();
    const compressed = this.walk.singleSegments(this.parts.length === 1 ? this.parts[0]! : Buffer.concat(this.parts, this.received));
    this.parts.length = 0;
    let plain: Buffer;
    try {
      plain = await decoder.decode(compressed);
    } catch (e) {
      throw notZstd(e instanceof Error ? e.message : String(e));
    }
    // What the bounds guarantee (libzstd holds each frame to them); restated, not relied on.
    if (plain.length > this.walk.bound) throw notZstd(`it inflated to ${plain.length} bytes, more than its frames allow (${this.walk.bound})`);
    return plain;
  }
}

type WalkState = 'magic' | 'descriptor' | 'frame-header' | 'skippable-size' | 'block-header';

/**
 * Frame and block headers of a zstd stream, read as the bytes arrive (RFC 8878 §3.1): the payloads
 * are skipped by their sizes, never read. Throws a BrokerError at the first header it refuses.
 */
class FrameWalk {
  /** The most the frames so far inflate to: declared content sizes, else what their blocks can hold. */
  bound = 0;
  private state: WalkState = 'magic';
  /** Header bytes needed for `state`, and those gathered so far. */
  private want = 4;
  private header: number[] = [];
  /** Payload bytes to skip before the next header. */
  private skip = 0;
  /** Bytes read so far: where the next byte is in the body. */
  private pos = 0;
  private frames = 0;
  /** The current frame: its descriptor and where it is, its largest block, whether its size is declared. */
  private descriptor = 0;
  private descriptorAt = 0;
  private blockMax = 0;
  private declared = false;
  private checksum = false;
  /** Where the window descriptor is, of each frame to decode as a single segment. */
  private readonly windowBytes: number[] = [];

  constructor(private readonly maxBytes: number) {}

  push(chunk: Buffer): void {
    let i = 0;
    while (i < chunk.length) {
      if (this.skip > 0) {
        const n = Math.min(this.skip, chunk.length - i);
        this.skip -= n;
        i += n;
        continue;
      }
      this.header.push(chunk[i++]!);
      if (this.header.length === this.want) this.onHeader(this.pos + i);
    }
    this.pos += chunk.length;
  }

  end(): void {
    if (this.state !== 'magic' || this.header.length > 0 || this.skip > 0) throw notZstd('the body ends inside a frame');
  }

  /**
   * `body` with every frame that declares its size (and is not one segment already) marked as a
   * single segment: its descriptor's flag set and its window descriptor dropped (RFC 8878 §3.1.1.1).
   */
  singleSegments(body: Buffer): Buffer {
    if (this.windowBytes.length === 0) return body;
    const parts: Buffer[] = [];
    let from = 0;
    for (const at of this.windowBytes) {
      parts.push(body.subarray(from, at));
      from = at + 1;
    }
    parts.push(body.subarray(from));
    const out = Buffer.concat(parts);
    this.windowBytes.forEach((at, j) => (out[at - 1 - j] = body[at - 1]! | SINGLE_SEGMENT));
    return out;
  }

  /** `this.header` holds the `want` bytes of the part named by `state`; `end` is the position after them. */
  private onHeader(end: number): void {
    const h = this.header;
    this.header = [];
    switch (this.state) {
      case 'magic': {
        const magic = le(h, 0, 4);
        if (magic === ZSTD_MAGIC) return this.expect('descriptor', 1);
        if (isSkippableMagic(magic)) return this.expect('skippable-size', 4);
        throw notZstd(this.frames === 0 ? 'it does not start with a zstd frame' : `unknown data after frame ${this.frames}`);
      }
      case 'skippable-size':
        this.skip = le(h, 0, 4);
        this.frames++;
        return this.expect('magic', 4);
      case 'descriptor': {
        const d = h[0]!;
        if (d & 0x08) throw notZstd('a frame header sets its reserved bit');
        this.descriptor = d;
        this.descriptorAt = end - 1;
        const { single, dictBytes, fcsBytes } = descriptorFields(d);
        return this.expect('frame-header', (single ? 0 : 1) + dictBytes + fcsBytes);
      }
      case 'frame-header':
        return this.onFrameHeader(h);
      case 'block-header': {
        const b = le(h, 0, 3);
        const last = b & 1;
        const type = (b >> 1) & 3;
        const size = b >>> 3;
        if (type === 3) throw notZstd('a block has the reserved type 3');
        if (size > this.blockMax) throw notZstd(`a block of ${size} bytes is larger than its frame allows (${this.blockMax})`);
        // Raw and compressed blocks carry `size` bytes, an RLE block one byte repeated `size` times;
        // a compressed block regenerates at most blockMax bytes.
        this.skip = type === 1 ? 1 : size;
        if (!this.declared) this.grow(type === 2 ? this.blockMax : size);
        if (!last) return this.expect('block-header', 3);
        this.frames++;
        this.skip += this.checksum ? 4 : 0;
        return this.expect('magic', 4);
      }
    }
  }

  /** The frame header after its descriptor: window, dictionary and content size. */
  private onFrameHeader(h: number[]): void {
    const { single, dictBytes, fcsBytes } = descriptorFields(this.descriptor);
    let at = 0;
    let window = 0;
    if (!single) {
      const w = h[at++]!;
      const base = 2 ** (10 + (w >> 3));
      window = base + (base / 8) * (w & 7);
    }
    const dictId = le(h, at, dictBytes);
    at += dictBytes;
    if (dictId !== 0) throw notZstd(`a frame needs dictionary ${dictId}; this server has no zstd dictionaries`);
    this.declared = fcsBytes > 0;
    if (this.declared) {
      const contentSize = le(h, at, fcsBytes) + (fcsBytes === 2 ? 256 : 0);
      this.grow(contentSize);
      if (!single) this.windowBytes.push(this.descriptorAt + 1);
      // A single-segment frame's window is its whole content.
      if (single) window = contentSize;
    } else if (window > MAX_WINDOW_BYTES) {
      throw notZstd(`a frame that does not declare its content size has a window of ${window} bytes, over RFC 9659's ${MAX_WINDOW_BYTES}`);
    }
    this.blockMax = Math.min(window, MAX_BLOCK_BYTES);
    this.checksum = ((this.descriptor >> 2) & 1) === 1;
    this.expect('block-header', 3);
  }

  private grow(bytes: number): void {
    this.bound += bytes;
    if (this.bound > this.maxBytes) throw inflatesTooLarge(this.maxBytes);
  }

  private expect(state: WalkState, bytes: number): void {
    this.state = state;
    this.want = bytes;
  }
}

/** The frame header descriptor's fields (RFC 8878 §3.1.1.1.1). */
function descriptorFields(d: number): { single: boolean; dictBytes: number; fcsBytes: number } {
  const single = ((d >> 5) & 1) === 1;
  const fcsFlag = d >> 6;
  return { single, dictBytes: [0, 1, 2, 4][d & 3]!, fcsBytes: fcsFlag === 0 ? (single ? 1 : 0) : 1 << fcsFlag };
}

/** `n` bytes of `h` from `at`, little-endian (up to 8: past 2^53 the value is only approximate, and far past any limit). */
function le(h: number[], at: number, n: number): number {
  let v = 0;
  for (let j = 0; j < n; j++) v += h[at + j]! * 2 ** (8 * j);
  return v;
}
