/**
 * A streaming look at a ForwardBackwardRequest body (tinker_public.proto) while it arrives: it reads
 * only tags and lengths, never the arrays, and finds a datum that cannot fit any served model
 * before the rest of the body is read. A body is otherwise buffered whole (up to
 * TB_MAX_TRAIN_BODY_MB) and decoded under the model's exact bounds by the route; this only lets a
 * huge datum be refused after its first bytes instead of after 64 MiB of reading and copying.
 *
 * Checked, per datum (`data`, field 3): its text tokens (Datum.model_input → Chunk.encoded_text →
 * EncodedTextChunk.tokens, 4 bytes each) ≤ `maxTokens`; every loss input's dense bytes and sparse
 * arrays (Datum.loss_fn_inputs → Tensor) ≤ `maxTensorBytes`. `model_id` and `seq_id` are kept when
 * they come first (the SDK writes fields in number order), so a refusal can use up the seq_id.
 * Anything malformed ends the scan quietly: the full decoder reports it with its own message.
 */
export type ScanLimits = { maxTokens: number; maxTensorBytes: number };
export type ScanRefusal = { message: string; datum: number };

// What each length-delimited field opens, by the message it is in: [message, field] → message.
type Msg = 'request' | 'datum' | 'chunk' | 'text' | 'entry' | 'tensor' | 'sparse';
const OPENS: Partial<Record<Msg, Record<number, Msg>>> = {
  request: { 3: 'datum' },
  datum: { 1: 'chunk', 2: 'entry' },
  chunk: { 1: 'text' },
  entry: { 2: 'tensor' },
  tensor: { 2: 'sparse' },
};

export class ForwardBackwardScan {
  /** Set once a datum is past the limits; the scan stops. */
  refusal: ScanRefusal | null = null;
  modelId: string | null = null;
  seqId: number | null = null;
  private chunks: Buffer[] = [];
  private chunkStart = 0; // absolute offset of chunks[0]
  private received = 0;
  private pos = 0; // absolute offset of the next byte to parse
  private skipTo = 0; // payload being skipped ends here
  private stack: { msg: Msg; end: number }[] = [{ msg: 'request', end: Infinity }];
  private datum = -1;
  private tokens = 0;
  private stopped = false;
  private captureTo: 'model_id' | null = null;
  private captureEnd = 0;
  private captured: Buffer[] = [];

  constructor(private readonly limits: ScanLimits) {}

  /** Feeds the next piece of the body; returns the refusal once there is one. */
  push(chunk: Buffer): ScanRefusal | null {
    this.chunks.push(chunk);
    this.received += chunk.length;
    if (!this.stopped) this.run();
    // Keep only what is not parsed yet (a varint or a model_id across chunk boundaries).
    while (this.chunks.length && this.chunkStart + this.chunks[0]!.length <= this.pos) {
      this.chunkStart += this.chunks.shift()!.length;
    }
    return this.refusal;
  }

  private byteAt(abs: number): number {
    let off = abs - this.chunkStart;
    for (const c of this.chunks) {
      if (off < c.length) return c[off]!;
      off -= c.length;
    }
    return -1;
  }

  private slice(from: number, to: number): Buffer {
    const parts: Buffer[] = [];
    let base = this.chunkStart;
    for (const c of this.chunks) {
      const s = Math.max(from - base, 0);
      const e = Math.min(to - base, c.length);
      if (s < e) parts.push(c.subarray(s, e));
      base += c.length;
    }
    return Buffer.concat(parts);
  }

  /** A varint at `pos`, or null when its bytes have not all arrived (or it is malformed). */
  private varint(): number | null {
    let v = 0;
    let mul = 1;
    for (let i = 0; i < 10; i++) {
      if (this.pos + i >= this.received) return null;
      const b = this.byteAt(this.pos + i);
      v += (b & 0x7f) * mul;
      mul *= 128;
      if (b < 0x80) {
        this.pos += i + 1;
        return v;
      }
    }
    this.stop();
    return null;
  }

  private stop(): void {
    this.stopped = true;
    this.chunks = [];
  }

  private refuse(message: string): void {
    this.refusal = { message: `data[${this.datum}]: ${message}`, datum: this.datum };
    this.stop();
  }

  private run(): void {
    while (!this.stopped) {
      if (this.captureTo) {
        const end = Math.min(this.captureEnd, this.received);
        this.captured.push(this.slice(this.pos, end));
        this.pos = end;
        if (end < this.captureEnd) return;
        this.modelId = Buffer.concat(this.captured).toString('utf8');
        this.captureTo = null;
        this.captured = [];
      }
      if (this.pos < this.skipTo) {
        this.pos = Math.min(this.skipTo, this.received);
        if (this.pos < this.skipTo) return;
      }
      // Close the messages that end here.
      let top = this.stack[this.stack.length - 1]!;
      while (this.stack.length > 1 && this.pos >= top.end) {
        if (this.pos > top.end) return this.stop();
        this.stack.pop();
        top = this.stack[this.stack.length - 1]!;
      }
      if (this.pos >= this.received) return;
      const start = this.pos;
      const tag = this.varint();
      if (tag === null) return;
      const field = Math.floor(tag / 8);
      const wire = tag & 7;
      if (wire === 0) {
        const v = this.varint();
        if (v === null) return void (this.stopped || (this.pos = start));
        if (top.msg === 'request' && field === 2) this.seqId = v > 0x7fffffff ? v - 2 ** 32 : v;
      } else if (wire === 1) this.skipTo = this.pos + 8;
      else if (wire === 5) this.skipTo = this.pos + 4;
      else if (wire === 2) {
        const len = this.varint();
        if (len === null) return void (this.stopped || (this.pos = start));
        const end = this.pos + len;
        if (end > top.end) return this.stop();
        const opens = OPENS[top.msg]?.[field];
        if (opens) {
          if (opens === 'datum') {
            this.datum++;
            this.tokens = 0;
          }
          this.stack.push({ msg: opens, end });
        } else {
          if (top.msg === 'text' && field === 1) {
            this.tokens += Math.floor(len / 4);
            if (this.tokens > this.limits.maxTokens)
              return this.refuse(`${this.tokens} tokens or more exceed the longest context served here (${this.limits.maxTokens})`);
          } else if ((top.msg === 'tensor' && field === 1) || top.msg === 'sparse') {
            if (len > this.limits.maxTensorBytes)
              return this.refuse(`a loss_fn_inputs tensor of ${len} bytes is larger than any model served here accepts (${this.limits.maxTensorBytes})`);
          } else if (top.msg === 'request' && field === 1 && len <= 1024) {
            this.captureTo = 'model_id';
            this.captureEnd = end;
            continue;
          }
          this.skipTo = end;
        }
      } else return this.stop(); // groups (3, 4) and unknown wire types: malformed
    }
  }
}
