import { createHash } from 'node:crypto';
import { readFileSync } from 'node:fs';
import type { Redis } from 'ioredis';

/**
 * The Lua scripts of the broker, one file each under `queues/runtime/lua/`, and one typed definition
 * each in `scripts` below. A definition names the script's KEYS and ARGV in the order the script reads
 * them, and its answer codes; a caller passes keys and arguments by name
 * (`scripts.outcomeClaim.run(redis, { keys: { outcome }, args: { record, ttlS } })`) and compares the
 * answer with a named code. Each file's header lists the same names (`KEYS[1] outcome: ...`):
 * test/lua-scripts.test.ts checks that the two agree, and that every code a script returns is named here.
 *
 * A file may pull in a library of functions with a line `--- @include "<name>"` (`lua/<name>.lua`).
 * Each script is read and assembled once per process and run by its SHA1 (EVALSHA): Redis compiles it
 * once; after a Redis restart (NOSCRIPT) the full text is sent once more.
 */

/** A value sent as one ARGV (Redis receives its text). */
export type ScriptArg = string | number;

/** An answer code: a number, or a word for the scripts that answer with one. */
export type ScriptCode = number | string;

type Codes = Readonly<Record<string, ScriptCode>>;

/** The keys and arguments of one call, by name. */
export type ScriptCall<K extends string, R extends string, A extends string, O extends string> = {
  keys: Readonly<Record<K, string>> & Readonly<Record<R, readonly string[]>>;
  args: Readonly<Record<A, ScriptArg>>;
  /** The optional arguments, all of them, or none (absent). */
  optional?: Readonly<Record<O, ScriptArg>> | undefined;
};

/** A script's optional arguments, by name (for a caller that builds them elsewhere). */
export type OptionalArgs<S> = S extends { optionalArgs?: infer O } ? (O extends readonly string[] ? Record<O[number], ScriptArg> : never) : never;

type Spec<F extends string, K extends readonly string[], R extends string, A extends readonly string[], O extends readonly string[], C extends Codes> = {
  /** The file, `lua/<file>.lua`. */
  file: F;
  /** KEYS[1..n], in order. */
  keys: K;
  /** The name of the keys after `keys` (KEYS[n+1..]), as many as the caller passes. */
  restKeys?: R;
  /** ARGV[1..n], in order. */
  args: A;
  /** ARGV after `args`, sent all together (a call's `optional`) or not at all (the script reads their absence). */
  optionalArgs?: O;
  /** The codes the script answers with, by name (a code inside a table answer is in `partCodes`). */
  codes: C;
  /** Codes that stand inside a table answer, by the part they stand in. */
  partCodes?: Readonly<Record<string, Codes>>;
};

/** One script: its definition, and `run`, which sends a call in the definition's order. */
export type ScriptDef<F extends string, K extends readonly string[], R extends string, A extends readonly string[], O extends readonly string[], C extends Codes, Reply> = Spec<F, K, R, A, O, C> & {
  run: (redis: Redis, call: ScriptCall<K[number], R, A[number], O[number]>) => Promise<Reply>;
};

/** Defines a script whose answer is `Reply` (the caller's view of the Lua table or value). */
function script<Reply>() {
  return <const F extends string, const K extends readonly string[], const A extends readonly string[], const C extends Codes, R extends string = never, const O extends readonly string[] = readonly []>(
    spec: Spec<F, K, R, A, O, C>,
  ): ScriptDef<F, K, R, A, O, C, Reply> => ({
    ...spec,
    run: async (redis, call) => (await evalScript(redis, spec.file, ...ordered(spec, call))) as Reply,
  });
}

/** KEYS and ARGV of a call, in the definition's order. */
function ordered(spec: Spec<string, readonly string[], string, readonly string[], readonly string[], Codes>, call: { keys: object; args: object; optional?: object | undefined }): [string[], ScriptArg[]] {
  const keys = call.keys as Record<string, string | readonly string[] | undefined>;
  const args = call.args as Record<string, ScriptArg | undefined>;
  const more = call.optional as Record<string, ScriptArg | undefined> | undefined;
  const given = <T>(v: T | undefined, what: string): T => {
    if (v === undefined) throw new Error(`script ${spec.file}: ${what} not given`);
    return v;
  };
  const k = spec.keys.map((n) => given(keys[n], `key '${n}'`) as string);
  if (spec.restKeys !== undefined) k.push(...(given(keys[spec.restKeys], `keys '${spec.restKeys}'`) as readonly string[]));
  const a = spec.args.map((n) => given(args[n], `argument '${n}'`));
  if (more !== undefined) a.push(...(spec.optionalArgs ?? []).map((n) => given(more[n], `optional argument '${n}'`)));
  return [k, a];
}

/** Answer codes of a take (train-take-lib.lua): whether the op's outcome was claimed with the job. */
export const TAKE_CLAIM = {
  /** Not claimed (not asked to; the agent claims it when its turn comes). */
  notClaimed: 0,
  claimed: 1,
  /** Another record was there first: the op must not run. */
  recordFirst: 2,
  /** The job's hash was gone: nothing taken is held (gate-submit's take only). */
  jobGone: -1,
} as const;

/** Words of liveness-beat.lua's answer. */
export const BEAT = { ok: 'ok', reaped: 'reaped', taken: 'taken' } as const;
export type BeatResult = (typeof BEAT)[keyof typeof BEAT];

/** A table answer of Lua: nil and false arrive as null. */
type Nullable<T> = T | null;

/** The Lua scripts, each with its KEYS, ARGV and codes; the header of `lua/<file>.lua` says what each means. */
export const scripts = {
  gateSubmit: script<number | [number, string] | [number, string, number, number, Nullable<string>, Nullable<string>[]]>()({
    file: 'gate-submit',
    keys: ['next', 'held', 'heldIndex', 'digests', 'gaps', 'agentAlive', 'owner', 'modelLast', 'agentDrained', 'model', 'agentRecovers', 'moved'],
    args: [
      'seqId', 'jobId', 'modelId', 'digest', 'window', 'gapMs', 'digestTtlMs', 'bullPrefix', 'queue', 'jobName', 'jobData', 'jobOpts',
      'timestamp', 'failedPrefix', 'failedTtlS', 'gapS', 'trainJobIdPrefix', 'tenant', 'ownerTtlS', 'nowIso', 'checkAgent', 'modelTtlMs', 'checkModel',
    ],
    optionalArgs: ['take', 'lockToken', 'lockMs', 'claim', 'outcomeBefore', 'outcomeAfter', 'agentId', 'tokenPrefix', 'outcomeTtlS'],
    codes: {
      admitted: 1,
      /** The same payload again, or a seq_id already past. */
      duplicate: 0,
      notOpen: -1,
      beyondWindow: -2,
      /** The seq_id was used with another payload. */
      otherPayload: -3,
      tooOld: -4,
      /** The model's agent is not alive, nor drained with this model saved for its restart. */
      agentGone: -5,
      /** `[modelLost, reason]`. */
      modelLost: -6,
      modelGone: -7,
      /** The model is on another queue now (adopted); the caller's copy of its record is old. */
      moved: -8,
    },
    partCodes: { claim: TAKE_CLAIM },
  }),
  gateRelease: script<number>()({
    file: 'gate-release',
    keys: ['next', 'held', 'heldIndex', 'digests', 'gaps'],
    args: ['modelId', 'window', 'gapMs', 'bullPrefix', 'failedPrefix', 'failedTtlS', 'gapS', 'trainJobIdPrefix'],
    /** The answer is how many held ops failed. */
    codes: { noneFailed: 0 },
  }),
  outcomeClaim: script<Nullable<string>>()({
    file: 'outcome-claim',
    keys: ['outcome'],
    args: ['record', 'ttlS'],
    codes: {},
  }),
  outcomeFinish: script<Nullable<string> | number>()({
    file: 'outcome-finish',
    keys: ['outcome'],
    restKeys: 'readOnce',
    args: ['record', 'ttlS', 'token', 'channel', 'jobId', 'signalMaxBytes', 'readOnceMs', 'handed'],
    optionalArgs: ['endQueuePrefix', 'lockToken', 'finishedOn'],
    /** What bullmq-job.lua bullCompleteJob did (with `endQueuePrefix`); the negative ones are BullMQ's. */
    codes: { ended: 1, leftForBullmq: 0, noJob: -1, noLock: -2, notActive: -3, lockOfAnother: -6 },
  }),
  outcomeRead: script<Nullable<string>>()({
    file: 'outcome-read',
    keys: ['outcome', 'job', 'owner'],
    args: ['readTtlMs', 'keep'],
    codes: {},
  }),
  outcomeRelease: script<number>()({
    file: 'outcome-release',
    keys: ['outcome'],
    args: ['token'],
    codes: { released: 1, notReleased: 0 },
  }),
  trainTake: script<null | [string[], string, number, number, Nullable<string>]>()({
    file: 'train-take',
    keys: ['wait', 'active', 'events', 'marker'],
    args: ['queuePrefix', 'now', 'lockToken', 'lockMs', 'claim', 'outcomeBefore', 'outcomeAfter', 'agentId', 'tokenPrefix', 'nowIso', 'outcomeTtlS'],
    codes: {},
    partCodes: { claim: TAKE_CLAIM },
  }),
  trainAdopt: script<[string, string?]>()({
    file: 'train-adopt',
    keys: ['active', 'wait', 'marker', 'events', 'job', 'lock', 'outcome'],
    args: ['jobId', 'lockToken', 'lockMs'],
    codes: { gone: 'gone', requeued: 'requeued', held: 'held' },
  }),
  trainRelocate: script<number>()({
    file: 'train-relocate',
    keys: ['model', 'orphans', 'held'],
    args: ['modelId', 'expected', 'record', 'bullPrefix', 'fromQueue', 'toQueue', 'trainJobIdPrefix', 'otherJobIds', 'movedBefore', 'movedAfter', 'movedTtlS', 'outcomeBefore', 'outcomeAfter'],
    /** Otherwise the answer is how many jobs moved. */
    codes: { changed: -1 },
  }),
  futureTrain: script<0 | Nullable<string>[]>()({
    file: 'future-train',
    keys: ['outcome', 'job', 'owner', 'failed', 'heldIndex', 'reaped', 'moved'],
    args: ['jobId', 'readTtlMs', 'keep', 'tenant', 'bullPrefix'],
    codes: { notOwner: 0 },
  }),
  sampleSubmit: script<number>()({
    file: 'sample-submit',
    keys: ['job', 'wait', 'owner', 'session'],
    args: ['queuePrefix', 'jobId', 'jobName', 'jobData', 'jobOpts', 'timestamp', 'maxWaiting', 'tenant', 'sessionTtlS', 'ownerTtlS'],
    codes: { queued: 1, replay: 0, full: -1, conflict: -2 },
  }),
  futureSample: script<0 | Nullable<string>[]>()({
    file: 'future-sample',
    keys: ['owner', 'job', 'failed'],
    args: ['tenant', 'readTtlMs'],
    codes: { notOwner: 0 },
  }),
  agentsLive: script<(string | number)[]>()({
    file: 'agents-live',
    keys: ['agents'],
    args: ['aliveBefore', 'aliveAfter'],
    codes: {},
  }),
  livenessBeat: script<BeatResult>()({
    file: 'liveness-beat',
    keys: ['alive', 'reaped', 'agents'],
    args: ['incarnation', 'ttlMs', 'agentId', 'record'],
    codes: BEAT,
  }),
  livenessRelease: script<number>()({
    file: 'liveness-release',
    keys: ['alive', 'agents'],
    args: ['incarnation', 'agentId'],
    codes: { released: 1, notHeld: 0 },
  }),
};

export type ScriptName = (typeof scripts)[keyof typeof scripts]['file'];

type Loaded = { lua: string; sha: string };
const loaded = new Map<string, Loaded>();

function assemble(file: string, seen: Set<string>): string {
  const text = readFileSync(new URL(`./lua/${file}.lua`, import.meta.url), 'utf8');
  return text.replace(/^--- @include "([a-z0-9-]+)"$/gm, (_, lib: string) => {
    if (seen.has(lib)) return '';
    seen.add(lib);
    return assemble(lib, seen);
  });
}

function load(file: string): Loaded {
  let s = loaded.get(file);
  if (!s) {
    const lua = assemble(file, new Set());
    s = { lua, sha: createHash('sha1').update(lua).digest('hex') };
    loaded.set(file, s);
  }
  return s;
}

/** Runs one script: one round trip (two the first time a Redis server sees it). */
async function evalScript(redis: Redis, file: string, keys: readonly string[], args: readonly ScriptArg[]): Promise<unknown> {
  const s = load(file);
  try {
    return await redis.evalsha(s.sha, keys.length, ...keys, ...args);
  } catch (e) {
    if (!String((e as Error).message).includes('NOSCRIPT')) throw e;
    return redis.eval(s.lua, keys.length, ...keys, ...args);
  }
}
