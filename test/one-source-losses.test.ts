import { spawnSync } from 'node:child_process';
import { readdirSync, readFileSync, statSync } from 'node:fs';
import path from 'node:path';
import { expect } from 'chai';
import ts from 'typescript';
import { BrokerError } from '../queues/contract/errors.js';
import { checkDatum, checkLossConfig, checkServerInputs, LOSSES, type LossEntry } from '../queues/contract/losses.js';

/**
 * Every rule about a loss lives in one place, queues/contract/losses.json. Both checkers (the API's
 * queues/contract/losses.ts, the engine's workers/python/tinker_engine/losses.py) read it; here
 * they judge the same cases, made from the catalogue itself, and must give the same verdict and
 * message. A rule written a second time on one side shows as a difference. A scan then finds loss
 * names (and config keys) written as string literals outside the catalogue's readers: a name
 * check in code is a rule that bypasses the catalogue.
 */

const PYTHON = path.resolve('.venv/bin/python');

type Config = Record<string, number | string>;
type Input = { shape: number[]; data: number[] };
type DatumCase = { loss: string; config: Config; inputs: Record<string, Input> };

/** The config keys the client must give, at a value inside their bounds. */
function required(entry: LossEntry): Config {
  return Object.fromEntries(Object.entries(entry.config).filter(([, c]) => c.default === null).map(([k]) => [k, 1]));
}

/** A value inside the key's bounds, and one just outside (null where it has none). */
function inside(c: LossEntry['config'][string]): number {
  return c.above !== undefined ? c.above + 0.5 : c.at_least !== undefined ? c.at_least : (c.default ?? 1);
}
function outside(c: LossEntry['config'][string]): number | null {
  return c.above !== undefined ? c.above : c.at_least !== undefined ? c.at_least - 1 : null;
}

/** loss_fn_config cases for every loss: good and bad values of each key, in each form the wire allows. */
function configCases(): [string, Config][] {
  const texts = ['1.5', ' 2 ', '.5', '5.', '+1e-1', '1E2', 'wide', '0x10', 'nan', 'Infinity', '1_0', '', '\u0661'];
  const cases: [string, Config][] = [];
  for (const [name, entry] of Object.entries(LOSSES)) {
    const base = required(entry);
    cases.push([name, {}], [name, base], [name, { ...base, zz_unknown: 1 }]);
    for (const [key, c] of Object.entries(entry.config)) {
      cases.push([name, { ...base, [key]: inside(c) }], [name, { ...base, [key]: String(inside(c)) }]);
      cases.push([name, { ...base, [key]: 100 }], [name, { ...base, [key]: 1e6 }], [name, { ...base, [key]: 0 }]);
      const out = outside(c);
      if (out !== null) cases.push([name, { ...base, [key]: out }], [name, { ...base, [key]: -1 }], [name, { ...base, [key]: -1e-7 }]);
      for (const t of texts) cases.push([name, { ...base, [key]: t }]);
    }
    for (const [a, b] of entry.ordered)
      cases.push([name, { ...base, [a]: 2, [b]: 1 }], [name, { ...base, [a]: 1, [b]: 1 }], [name, { ...base, [a]: 0.5, [b]: 3 }]);
  }
  return cases;
}

const tensor = (data: number[]): Input => ({ shape: [data.length], data });

/** Datum cases for every loss: per-token values of each key inside and outside its bounds, ordered pairs, datum rules. */
function datumCases(): DatumCase[] {
  const cases: DatumCase[] = [];
  for (const [loss, entry] of Object.entries(LOSSES)) {
    const base = required(entry);
    const n = 3;
    const plain: Record<string, Input> = Object.fromEntries(
      [...entry.inputs, ...entry.server_inputs].map((k) => [k, tensor(Array.from({ length: n }, () => 1))]),
    );
    cases.push({ loss, config: base, inputs: plain });
    for (const [key, c] of Object.entries(entry.config)) {
      const out = outside(c);
      const perToken = entry.optional_inputs.includes(key);
      // A bad config value of a key a datum may replace is judged per datum (the config check lets it through).
      if (out !== null && perToken) cases.push({ loss, config: { ...base, [key]: out }, inputs: plain });
      if (out !== null && perToken) cases.push({ loss, config: { ...base, [key]: out }, inputs: { ...plain, [key]: tensor([inside(c), inside(c), inside(c)]) } });
      if (out !== null && perToken) cases.push({ loss, config: base, inputs: { ...plain, [key]: tensor([inside(c), out, inside(c)]) } });
      if (perToken) cases.push({ loss, config: base, inputs: { ...plain, [key]: tensor([inside(c), inside(c) + 1, inside(c)]) } });
    }
    for (const [a, b] of entry.ordered) {
      cases.push({ loss, config: base, inputs: { ...plain, [a]: tensor([0.5, 3, 0.5]) } });
      cases.push({ loss, config: base, inputs: { ...plain, [a]: tensor([0.5, 0.5, 0.5]), [b]: tensor([1, 0.25, 1]) } });
      cases.push({ loss, config: { ...base, [a]: 0.5, [b]: 0.75 }, inputs: { ...plain, [b]: tensor([1, 0.75, 0.5]) } });
    }
    for (const rule of entry.datum_rules) {
      if ('some_nonzero' in rule) {
        cases.push({ loss, config: base, inputs: { ...plain, [rule.some_nonzero]: tensor([0, 0, 0]) } });
        cases.push({ loss, config: base, inputs: { ...plain, [rule.some_nonzero]: tensor([0, 0.5, 0]) } });
      } else {
        cases.push({ loss, config: base, inputs: { ...plain, [rule.zero_outside]: tensor([0, -2.5, 0]), [rule.mask]: tensor([1, 0, 1]) } });
        cases.push({ loss, config: base, inputs: { ...plain, [rule.zero_outside]: tensor([0, -2.5, 0]), [rule.mask]: tensor([0, 1, 0]) } });
        cases.push({ loss, config: base, inputs: { ...plain, [rule.zero_outside]: tensor([0, 0, 0]), [rule.mask]: tensor([0, 0, 0]) } });
      }
    }
  }
  // Only datums whose config passes (the config cases are judged above).
  return cases.filter((c) => verdict(() => checkLossConfig(c.loss, c.config)) === null);
}

/** The message of the user error `f` throws, or null when it passes. */
function verdict(f: () => unknown): string | null {
  try {
    f();
    return null;
  } catch (e) {
    expect(e).to.be.instanceOf(BrokerError);
    return (e as Error).message;
  }
}

/** TypeScript files of a folder, recursively. */
function tsFiles(dir: string): string[] {
  return readdirSync(dir).flatMap((f) => {
    const p = path.join(dir, f);
    if (f === 'node_modules') return [];
    if (statSync(p).isDirectory()) return tsFiles(p);
    return p.endsWith('.ts') ? [p] : [];
  });
}

/** The text of every string literal and template part in a TypeScript file, with its line. */
function tsStrings(file: string): { line: number; text: string }[] {
  const source = ts.createSourceFile(file, readFileSync(file, 'utf8'), ts.ScriptTarget.Latest, true);
  const out: { line: number; text: string }[] = [];
  const visit = (node: ts.Node): void => {
    if (ts.isStringLiteral(node) || ts.isNoSubstitutionTemplateLiteral(node) || ts.isTemplateHead(node) || ts.isTemplateMiddle(node) || ts.isTemplateTail(node))
      out.push({ line: source.getLineAndCharacterOfPosition(node.getStart()).line + 1, text: node.text });
    ts.forEachChild(node, visit);
  };
  visit(source);
  return out;
}

// The engine's side, in one Python process: each case through its checkers, and the string
// constants of its sources (docstrings left out).
const ENGINE = `
import ast, json, sys
from pathlib import Path
import torch
from tinker_engine.errors import UserError
from tinker_engine.losses import get_loss

def verdict(f):
    try:
        f()
        return None
    except UserError as e:
        return str(e)

def datum(case):
    spec = get_loss(case["loss"])
    config = spec.parse_config(case["config"])
    inputs = {k: torch.tensor(v["data"], dtype=torch.float32).reshape(v["shape"]) for k, v in case["inputs"].items()}
    spec.check(inputs, config, "datum 0")

def strings(path):
    tree = ast.parse(path.read_text())
    docs = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                docs.add(id(first.value))
    return [{"line": n.lineno, "text": n.value} for n in ast.walk(tree)
            if isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in docs]

cases = json.load(sys.stdin)
print(json.dumps({
    "configs": [verdict(lambda: get_loss(name).parse_config(config)) for name, config in cases["configs"]],
    "datums": [verdict(lambda: datum(c)) for c in cases["datums"]],
    "strings": {str(p): strings(p) for d in ("tinker_engine", "tinker_engine_verl") for p in sorted(Path(d).rglob("*.py"))},
}))
`;

describe('loss rules have one source, the catalogue, read alike by the API and the engine', function () {
  this.timeout(120_000);
  const configs = configCases();
  const datums = datumCases();
  let engine: { configs: (string | null)[]; datums: (string | null)[]; strings: Record<string, { line: number; text: string }[]> };

  before(() => {
    const r = spawnSync(PYTHON, ['-c', ENGINE], { cwd: 'workers/python', encoding: 'utf8', input: JSON.stringify({ configs, datums }) });
    expect(r.status, r.stderr).to.equal(0);
    engine = JSON.parse(r.stdout);
  });

  it('each loss_fn_config made from the catalogue gets the same verdict and message from both checkers', () => {
    configs.forEach(([name, config], i) => {
      expect(verdict(() => checkLossConfig(name, config)), `${name} ${JSON.stringify(config)}`).to.equal(engine.configs[i]);
    });
    // The cases reach every kind of verdict: accepted, and each refusal of the config check.
    const messages = engine.configs.filter((m): m is string => m !== null);
    expect(messages.length).to.be.below(configs.length);
    for (const kind of ['has unknown keys', 'requires loss_fn_config', 'must be a finite number', 'must be >= ', 'must not exceed'])
      expect(messages.some((m) => m.includes(kind)), kind).to.equal(true);
  });

  it('each datum made from the catalogue gets the same verdict and message from both checkers; the API checks the server-input rules alike', () => {
    let serverRefusals = 0;
    datums.forEach((c, i) => {
      const label = `${c.loss} ${JSON.stringify(c)}`;
      const config = checkLossConfig(c.loss, c.config);
      const api = verdict(() => checkDatum(c.loss, c.inputs, config, 'datum 0'));
      expect(api, label).to.equal(engine.datums[i]);
      // What the API checks when it adds the server inputs is a part of the same rules, with the same message.
      const server = verdict(() => checkServerInputs(c.loss, c.inputs, 'datum 0'));
      if (server !== null) {
        expect(server, label).to.equal(api);
        serverRefusals++;
      }
    });
    const messages = engine.datums.filter((m): m is string => m !== null);
    expect(messages.length).to.be.below(datums.length);
    for (const kind of ['must be > ', 'must be >= ', 'exceeds', 'marks no token', 'position 1 is not a sampled token'])
      expect(messages.some((m) => m.includes(kind)), kind).to.equal(true);
    expect(serverRefusals).to.be.at.least(1);
  });

  // Where a loss name or config key may be written as text outside the catalogue's readers, and why.
  const ALLOWED: Record<string, string> = {
    // get_server_capabilities' notes: prose for clients about what each loss does here.
    'api/routes/service.ts': 'documentation for clients',
  };
  const names = Object.keys(LOSSES);
  const keys = [...new Set(Object.values(LOSSES).flatMap((e) => Object.keys(e.config)))];
  const pattern = (words: string[]) => new RegExp(`\\b(${words.join('|')})\\b`);

  it('no loss name or config key is written as a string literal in api/, queues/ or workers/ (TypeScript) outside losses.ts', () => {
    const found: string[] = [];
    for (const file of ['api', 'queues', 'workers'].flatMap(tsFiles)) {
      if (file === path.join('queues', 'contract', 'losses.ts') || Object.hasOwn(ALLOWED, file)) continue;
      for (const s of tsStrings(file)) {
        const m = pattern([...names, ...keys]).exec(s.text);
        if (m) found.push(`${file}:${s.line}: '${m[1]}' in ${JSON.stringify(s.text)}`);
      }
    }
    expect(found).to.deep.equal([]);
  });

  it('no loss name is written as a string constant in the Python engines (their math reads config keys, nothing names a loss)', () => {
    const found: string[] = [];
    for (const [file, strings] of Object.entries(engine.strings))
      for (const s of strings) {
        const m = pattern(names).exec(s.text);
        if (m) found.push(`${file}:${s.line}: '${m[1]}' in ${JSON.stringify(s.text)}`);
      }
    expect(Object.keys(engine.strings)).to.include('tinker_engine/losses.py');
    expect(found).to.deep.equal([]);
  });
});
