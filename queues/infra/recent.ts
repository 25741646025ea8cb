/**
 * Reads of Redis shared by the callers of a hot path that ask the same thing many times a second (a
 * burst of sample requests: bench/request-cost.ts).
 *
 * - A read still in flight is shared by every caller that asks meanwhile: their answer is no older
 *   than a read of their own would be by more than one round trip.
 * - An answer is used again for `windowMs` after it came (0: not at all), when `accept` takes it;
 *   otherwise the key is read afresh (so a record just created, that an earlier read did not find,
 *   is found at once).
 * - A failed read is not kept.
 * - At most `max` keys are kept; the oldest go first.
 *
 * A window is only for records that never change once written (only expire), or whose change the
 * caller can afford to see that much later.
 */
export class RecentReads<T> {
  private readonly reads = new Map<string, { value: Promise<T>; answeredAt: number | null }>();

  constructor(
    private readonly windowMs: number,
    private readonly max = 1024,
  ) {}

  async get(key: string, read: () => Promise<T>, accept: (v: T) => boolean = () => true): Promise<T> {
    const recent = this.reads.get(key);
    if (recent && (recent.answeredAt === null || Date.now() - recent.answeredAt <= this.windowMs)) {
      const v = await recent.value.then(
        (x) => ({ x }),
        () => null,
      );
      if (v && accept(v.x)) return v.x;
    }
    const value = read();
    const entry = { value, answeredAt: null as number | null };
    this.reads.delete(key);
    this.reads.set(key, entry);
    if (this.reads.size > this.max) this.reads.delete(this.reads.keys().next().value!);
    const settled = (ok: boolean) => {
      if (this.reads.get(key) !== entry) return;
      if (ok && this.windowMs > 0) entry.answeredAt = Date.now();
      else this.reads.delete(key);
    };
    value.then(
      () => settled(true),
      () => settled(false),
    );
    return value;
  }
}
