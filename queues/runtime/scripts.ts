import { createHash } from 'node:crypto';
import { readFileSync } from 'node:fs';
import type { Redis } from 'ioredis';

/**
 * The Lua scripts of the broker, one file each under `queues/runtime/lua/` with a KEYS/ARGV header. A file
 * may pull in a library of functions with a line `--- @include "<name>"` (`lua/<name>.lua`). Each
 * script is read and assembled once per process and run by its SHA1 (EVALSHA): Redis compiles it
 * once; after a Redis restart (NOSCRIPT) the full text is sent once more.
 */
export type ScriptName =
  | 'gate-submit'
  | 'gate-release'
  | 'outcome-claim'
  | 'outcome-finish'
  | 'outcome-read'
  | 'outcome-release'
  | 'train-take'
  | 'train-adopt'
  | 'future-train'
  | 'sample-submit'
  | 'future-sample'
  | 'agents-live'
  | 'liveness-beat'
  | 'liveness-release';

type Loaded = { lua: string; sha: string };
const loaded = new Map<ScriptName, Loaded>();

function assemble(file: string, seen: Set<string>): string {
  const text = readFileSync(new URL(`./lua/${file}.lua`, import.meta.url), 'utf8');
  return text.replace(/^--- @include "([a-z0-9-]+)"$/gm, (_, lib: string) => {
    if (seen.has(lib)) return '';
    seen.add(lib);
    return assemble(lib, seen);
  });
}

function script(name: ScriptName): Loaded {
  let s = loaded.get(name);
  if (!s) {
    const lua = assemble(name, new Set());
    s = { lua, sha: createHash('sha1').update(lua).digest('hex') };
    loaded.set(name, s);
  }
  return s;
}

/** Runs one script: one round trip (two the first time a Redis server sees it). */
export async function runScript(redis: Redis, name: ScriptName, keys: readonly string[], args: readonly (string | number)[]): Promise<unknown> {
  const s = script(name);
  try {
    return await redis.evalsha(s.sha, keys.length, ...keys, ...args);
  } catch (e) {
    if (!String((e as Error).message).includes('NOSCRIPT')) throw e;
    return redis.eval(s.lua, keys.length, ...keys, ...args);
  }
}
