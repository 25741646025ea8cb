import { readdirSync, readFileSync } from 'node:fs';
import { randomUUID } from 'node:crypto';
import { expect } from 'chai';
import { Redis } from 'ioredis';
import { scripts, type ScriptCode } from '../queues/runtime/scripts.js';
import { deletePrefix, REDIS_URL } from './helpers/stack.js';

/**
 * The Lua scripts and their TypeScript definitions (queues/runtime/scripts.ts) cannot drift: each
 * file's KEYS/ARGV header names what the definition names, in the same order; the script reads no
 * KEYS[n] or ARGV[n] past them; and every literal code it can return is a named code.
 */

const LUA_DIR = new URL('../queues/runtime/lua/', import.meta.url);
const readLua = (file: string): string => readFileSync(new URL(`${file}.lua`, LUA_DIR), 'utf8');

type Entry = { index: number; rest: boolean; name: string };

/** The `KEYS[n] name:` and `ARGV[n] name:` entries of a file's header comment (the first `--[[ ]]`). */
function headerEntries(lua: string): { keys: Entry[]; args: Entry[] } {
  const header = /^--\[\[([\s\S]*?)\]\]/.exec(lua)?.[1] ?? '';
  const keys: Entry[] = [];
  const args: Entry[] = [];
  for (const m of header.matchAll(/\b(KEYS|ARGV)\[(\d+)(\.\.)?\]\s+([A-Za-z][A-Za-z0-9]*):/g)) {
    (m[1] === 'KEYS' ? keys : args).push({ index: Number(m[2]), rest: m[3] !== undefined, name: m[4]! });
  }
  return { keys, args };
}

/** The code of a Lua text, without comments. */
function code(lua: string): string {
  return lua.replace(/--\[\[[\s\S]*?\]\]/g, '').replace(/--[^\n]*/g, '');
}

/** The largest n of `KEYS[n]` / `ARGV[n]` the code reads (0: none). */
function maxIndex(lua: string, which: 'KEYS' | 'ARGV'): number {
  return Math.max(0, ...[...code(lua).matchAll(new RegExp(`\\b${which}\\[(\\d+)\\]`, 'g'))].map((m) => Number(m[1])));
}

/** Each `return` statement's expression (to where its brackets close and its line ends). */
function returns(lua: string): string[] {
  const out: string[] = [];
  const lines = code(lua).split('\n');
  for (let i = 0; i < lines.length; i++) {
    const at = lines[i]!.search(/\breturn\b/);
    if (at < 0) continue;
    let expr = lines[i]!.slice(at + 'return'.length);
    const depth = (s: string) => (s.match(/[({]/g)?.length ?? 0) - (s.match(/[)}]/g)?.length ?? 0);
    while (depth(expr) > 0 && i + 1 < lines.length) expr += `\n${lines[++i]}`;
    out.push(expr.replace(/\bend\s*$/, ''));
  }
  return out;
}

/** The literal values a `return` expression can give: numbers (with a unary minus) and strings, not those passed to redis.call. */
function returnedLiterals(expr: string): ScriptCode[] {
  const out: ScriptCode[] = [];
  const rest = expr
    .replace(/redis\.call\(\s*'[^']*'/g, 'redis.call(')
    .replace(/'([^']*)'|"([^"]*)"/g, (_, a?: string, b?: string) => {
      out.push(a ?? b ?? '');
      return ' s ';
    })
    .replace(/\[[^\]]*\]/g, '');
  const tokens = rest.match(/[A-Za-z_][A-Za-z0-9_]*|\d+(?:\.\d+)?|\.\.|[^\sA-Za-z0-9_]/g) ?? [];
  const operand = (t: string | undefined) => t !== undefined && (/^[A-Za-z_0-9]/.test(t) && !['and', 'or', 'not', 'return'].includes(t) || t === ')' || t === '}');
  tokens.forEach((t, i) => {
    if (!/^\d/.test(t)) return;
    const unary = tokens[i - 1] === '-' && !operand(tokens[i - 2]);
    out.push(unary ? -Number(t) : Number(t));
  });
  return out;
}

/** The body of a `local function <name>(` in a library, to the `end` at the line's start. */
function functionBody(lib: string, name: string): string | undefined {
  return new RegExp(`^local function ${name}\\([\\s\\S]*?^end$`, 'm').exec(lib)?.[0];
}

/** The libraries a file includes (`--- @include "<name>"`), with theirs. */
function includes(lua: string, seen = new Set<string>()): string[] {
  for (const m of lua.matchAll(/^--- @include "([a-z0-9-]+)"$/gm)) {
    if (seen.has(m[1]!)) continue;
    seen.add(m[1]!);
    includes(readLua(m[1]!), seen);
  }
  return [...seen];
}

/** Every literal a script can return: its own `return`s, and those of a library function it returns the answer of. */
function scriptReturns(lua: string, libs: string[]): ScriptCode[] {
  const out: ScriptCode[] = [];
  for (const expr of returns(lua)) {
    out.push(...returnedLiterals(expr));
    for (const m of expr.matchAll(/^\s*([A-Za-z_][A-Za-z0-9_]*)\(/g)) {
      for (const lib of libs) {
        const body = functionBody(lib, m[1]!);
        if (body) for (const e of returns(body)) out.push(...returnedLiterals(e));
      }
    }
  }
  return out;
}

const defs = Object.entries(scripts);

describe('Lua scripts and their definitions', () => {
  it('every .lua file is a defined script or a library one includes', () => {
    const files = readdirSync(LUA_DIR).filter((f) => f.endsWith('.lua')).map((f) => f.slice(0, -4));
    const defined = new Set<string>(defs.map(([, d]) => d.file));
    const libs = new Set(files.flatMap((f) => includes(readLua(f))));
    for (const f of files) expect(defined.has(f) || libs.has(f), `${f}.lua has no definition in queues/runtime/scripts.ts`).to.equal(true);
    for (const f of defined) expect(files, `the file of script ${f}`).to.include(f);
    for (const f of libs) expect(defined.has(f), `${f}.lua is a library and a script`).to.equal(false);
  });

  for (const [name, def] of defs) {
    describe(`${name} (${def.file}.lua)`, () => {
      const lua = readLua(def.file);
      const header = headerEntries(lua);
      const restKeys = 'restKeys' in def ? def.restKeys : undefined;
      const optionalArgs: readonly string[] = ('optionalArgs' in def ? def.optionalArgs : undefined) ?? [];

      it('its header names the KEYS of the definition, in order', () => {
        const want = [...def.keys.map((n, i) => ({ index: i + 1, rest: false, name: n })), ...(restKeys ? [{ index: def.keys.length + 1, rest: true, name: restKeys }] : [])];
        expect(header.keys).to.deep.equal(want);
      });

      it('its header names the ARGV of the definition, in order', () => {
        expect(header.args).to.deep.equal([...def.args, ...optionalArgs].map((n, i) => ({ index: i + 1, rest: false, name: n })));
      });

      it('reads no KEYS or ARGV past those named', () => {
        if (!restKeys) expect(maxIndex(lua, 'KEYS')).to.be.at.most(def.keys.length);
        expect(maxIndex(lua, 'ARGV')).to.be.at.most(def.args.length + optionalArgs.length);
      });

      it('returns only codes the definition names', () => {
        const named = new Set<ScriptCode>([def.codes, ...Object.values(('partCodes' in def ? def.partCodes : undefined) ?? {})].flatMap((c) => Object.values(c)));
        const returned = new Set(scriptReturns(lua, includes(lua).map(readLua)));
        for (const c of returned) expect(named.has(c), `${def.file}.lua returns ${JSON.stringify(c)}, which scripts.${name} does not name`).to.equal(true);
      });
    });
  }
});

describe('the checks of Lua scripts', () => {
  it('find a header entry that is missing, renamed or out of order', () => {
    const lua = "--[[\n  KEYS[1] outcome: the record   KEYS[2] job: the job\n  ARGV[2] ttlS: ttl   ARGV[1] record: it\n]]\nreturn 1";
    expect(headerEntries(lua)).to.deep.equal({
      keys: [{ index: 1, rest: false, name: 'outcome' }, { index: 2, rest: false, name: 'job' }],
      args: [{ index: 2, rest: false, name: 'ttlS' }, { index: 1, rest: false, name: 'record' }],
    });
  });

  it('find the literal codes a return gives, negative ones included', () => {
    expect(returnedLiterals(' lock and -6 or -2')).to.deep.equal([-6, -2]);
    expect(returnedLiterals(" owned({ 1, id, more, -1, false, {} })")).to.deep.equal([1, -1]);
    expect(returnedLiterals(" { 'held', o }")).to.deep.equal(['held']);
    expect(returnedLiterals(" nxt - start")).to.deep.equal([]);
    expect(returnedLiterals(" now - 1")).to.deep.equal([1]);
    expect(returnedLiterals(" redis.call('HGETALL', ARGV[1] .. jobId)")).to.deep.equal([]);
  });

  it("follow a library function whose answer the script returns", () => {
    const lib = 'local function f(x)\n  if x then return -9 end\n  return 3\nend\n';
    expect(scriptReturns("if a then return -1 end\nreturn f(ARGV[1])", [lib])).to.deep.equal([-1, -9, 3]);
    expect(scriptReturns("local r = f(ARGV[1])\nreturn r", [lib])).to.deep.equal([]);
  });
});

describe('a script called by names', () => {
  let redis: Redis;
  let prefix: string;
  before(() => {
    redis = new Redis(REDIS_URL, { maxRetriesPerRequest: null });
  });
  beforeEach(() => {
    prefix = `test-${randomUUID().slice(0, 8)}`;
  });
  afterEach(async () => deletePrefix(prefix));
  after(() => redis.disconnect());

  it('sends its KEYS and ARGV in the order of the definition', async () => {
    const outcome = `${prefix}:outcome`;
    const claim = (record: string) => scripts.outcomeClaim.run(redis, { keys: { outcome }, args: { ttlS: 60, record } });
    expect(await claim('{"state":"running"}')).to.equal(null);
    expect(await claim('{"state":"done"}')).to.equal('{"state":"running"}');
    expect(await redis.ttl(outcome)).to.be.within(1, 60);
  });

  it('sends the optional arguments all together, or none', async () => {
    const keys = { outcome: `${prefix}:outcome`, readOnce: [] };
    const args = { record: '{"state":"done"}', ttlS: 60, token: '', channel: `${prefix}:ch`, jobId: 'j', signalMaxBytes: 1000, readOnceMs: 1000, handed: 0 };
    // No job end asked for: the record is written and nothing else is done.
    expect(await scripts.outcomeFinish.run(redis, { keys, args })).to.equal(null);
    // A job end asked for, of a job that does not exist: bullCompleteJob's code.
    await redis.del(keys.outcome);
    const r = await scripts.outcomeFinish.run(redis, { keys, args, optional: { endQueuePrefix: `${prefix}-bull:q:`, lockToken: 't', finishedOn: 1 } });
    expect(r).to.equal(scripts.outcomeFinish.codes.noJob);
  });

  it('refuses a call with a name missing', async () => {
    const call = { keys: { outcome: `${prefix}:outcome` }, args: { record: '{}' } } as unknown as Parameters<typeof scripts.outcomeClaim.run>[1];
    let error: unknown;
    await scripts.outcomeClaim.run(redis, call).catch((e: unknown) => (error = e));
    expect(String(error)).to.contain("argument 'ttlS' not given");
    expect(await redis.exists(`${prefix}:outcome`)).to.equal(0);
  });
});
