import { spawnSync } from 'node:child_process';
import { readFileSync } from 'node:fs';
import path from 'node:path';
import { expect } from 'chai';
import { z } from 'zod';
import { OptimStepBody, SamplingParamsBody } from '../api/http-schemas.js';
import { AdamParams, SamplingParams } from '../queues/contract/params.js';
import * as contract from '../queues/contract/schemas.js';
import { VLLM_SAMPLING_FIELDS } from '../workers/adapters/vllm/translate.js';

/**
 * The sampling and Adam parameters are declared once, in queues/contract/params.ts: each field, its
 * bound and its default. Every other side must derive from that file or read it. Here each side's view
 * is compared with it: the API bodies, the jobs, protocol.json (and the Python engines' checker of
 * it, on the same values), what the Python engines use when a field is left out, the vLLM field map.
 * A scan then looks for the distinctive defaults written as literals in another production file.
 */

const ROOT = path.resolve(import.meta.dirname, '..');
const PYTHON = path.join(ROOT, '.venv/bin/python');

const SOURCES = { sampling: SamplingParams, adam: AdamParams } as const;
type Kind = keyof typeof SOURCES;

/** The sampling fields the SDK's `stop` replaces in the API body. */
const STOP_FIELDS = ['stop_tokens', 'stop_strings', 'stop_at_eos'];

/** Values tried for every field: inside and outside each bound, other types, null. */
const PROBES: unknown[] = [-2, -1, -0.5, 0, 1e-12, 0.5, 0.9, 1, 1.5, 2, 256, 2 ** 53, null, 'x', true, [], [0], [-1], [1.5], ['a'], [''], {}];

type Case = { field: string; value: unknown; params: Record<string, unknown> };

function cases(kind: Kind): Case[] {
  const defaults = SOURCES[kind].parse({});
  return Object.keys(SOURCES[kind].shape).flatMap((field) => PROBES.map((value) => ({ field, value, params: { ...defaults, [field]: value } })));
}

/** Numbers just outside each numeric bound the protocol declares (Python must not check them again). */
function outOfBounds(kind: Kind): Record<string, unknown>[] {
  const defaults = SOURCES[kind].parse({});
  const props = (protocolEntry(kind) as { properties: Record<string, Record<string, number>> }).properties;
  const out: Record<string, unknown>[] = [];
  for (const [field, s] of Object.entries(props)) {
    const below = s.minimum !== undefined && s.minimum > -(2 ** 53) ? s.minimum - 1 : s.exclusiveMinimum;
    const above = s.maximum !== undefined && s.maximum < 2 ** 53 ? s.maximum + 1 : s.exclusiveMaximum;
    for (const v of [below, above]) if (v !== undefined) out.push({ ...defaults, [field]: v });
  }
  return out;
}

type ProtocolJson = { ops: Record<string, { args: { properties: Record<string, any> } }> };
const PROTOCOL: ProtocolJson = JSON.parse(readFileSync(path.join(ROOT, 'workers/python/tinker_engine/protocol.json'), 'utf8'));

/** Where protocol.json carries each schema: every op that takes it. */
const PROTOCOL_PLACES: Record<Kind, unknown[]> = {
  sampling: [PROTOCOL.ops.sample!.args.properties.sampling_params, PROTOCOL.ops.sample_batch!.args.properties.requests.items.properties.sampling_params],
  adam: [PROTOCOL.ops.optim_step!.args.properties.adam],
};
const protocolEntry = (kind: Kind): unknown => PROTOCOL_PLACES[kind][0];

/** What the Python side uses: its field lists, its values for an empty object, the protocol checker's verdicts. */
const PROBE = `
import dataclasses, json, sys
from tinker_engine.protocol import OPS, problem
from tinker_engine.sample import SamplingParams
from tinker_engine.train import AdamParams
from tinker_engine_verl.engine import initial_adam

def plain(obj):
    return {k: sorted(v) if isinstance(v, frozenset) else list(v) if isinstance(v, tuple) else v
            for k, v in dataclasses.asdict(obj).items()}

def raises(parse, params):
    try:
        parse(params)
        return None
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"

given = json.load(sys.stdin)
schemas = {"sampling": OPS["sample"]["args"]["properties"]["sampling_params"],
           "adam": OPS["optim_step"]["args"]["properties"]["adam"]}
classes = {"sampling": SamplingParams, "adam": AdamParams}
print(json.dumps({
    "fields": {k: [f.name for f in dataclasses.fields(c)] for k, c in classes.items()},
    "defaults": {k: plain(c.parse({})) for k, c in classes.items()},
    "verl_initial_adam": plain(initial_adam()),
    "protocol_ok": {k: [problem(c["params"], schemas[k], "x") is None for c in cs] for k, cs in given["cases"].items()},
    "parse_errors": {k: [raises(classes[k].parse, p) for p in ps] for k, ps in given["out_of_bounds"].items()},
}))
`;

type PythonView = {
  fields: Record<Kind, string[]>;
  defaults: Record<Kind, Record<string, unknown>>;
  verl_initial_adam: Record<string, unknown>;
  protocol_ok: Record<Kind, boolean[]>;
  parse_errors: Record<Kind, (string | null)[]>;
};

/** Production files that could restate a default: the broker's and the engines' sources. */
function productionFiles(): string[] {
  const listed = spawnSync('git', ['ls-files', '-co', '--exclude-standard', 'api', 'queues', 'workers', 'scripts', 'presets'], { cwd: ROOT, encoding: 'utf8' });
  expect(listed.status, listed.stderr).to.equal(0);
  return listed.stdout
    .split('\n')
    .filter((f) => /\.(ts|py|json|ya?ml)$/.test(f))
    .filter((f) => !f.includes('/tests/') && !f.includes('node_modules'))
    .filter((f) => f !== 'queues/contract/params.ts' && f !== 'workers/python/tinker_engine/protocol.json');
}

describe('one source for the sampling and Adam parameters (queues/contract/params.ts)', () => {
  const allCases = { sampling: cases('sampling'), adam: cases('adam') };
  let python: PythonView;

  before(function () {
    this.timeout(120_000);
    const run = spawnSync(PYTHON, ['-c', PROBE], {
      cwd: path.join(ROOT, 'workers/python'),
      input: JSON.stringify({ cases: allCases, out_of_bounds: { sampling: outOfBounds('sampling'), adam: outOfBounds('adam') } }),
      encoding: 'utf8',
      maxBuffer: 1 << 24,
    });
    expect(run.status, run.stderr).to.equal(0);
    python = JSON.parse(run.stdout) as PythonView;
  });

  it('the jobs carry the source schemas themselves', () => {
    expect(contract.SamplingParams).to.equal(SamplingParams);
    expect(contract.AdamParams).to.equal(AdamParams);
    expect(contract.SampleJob.shape.sampling_params).to.equal(SamplingParams);
    expect(contract.OptimStepJob.shape.adam).to.equal(AdamParams);
  });

  it("the API's optim_step body takes the Adam schema itself, with its defaults", () => {
    expect(OptimStepBody.shape.adam_params.unwrap()).to.equal(AdamParams);
    expect(OptimStepBody.shape.optim_params.unwrap()).to.equal(AdamParams);
    const body = OptimStepBody.parse({ model_id: 'm', seq_id: 1, adam_params: {}, optim_params: {} });
    expect(body.adam_params).to.deep.equal(AdamParams.parse({}));
    expect(body.optim_params).to.deep.equal(AdamParams.parse({}));
  });

  it("the API's sampling body has the source's fields (stop in place of the stop fields), defaults and verdicts", () => {
    const shared = Object.keys(SamplingParams.shape).filter((k) => !STOP_FIELDS.includes(k));
    expect(Object.keys(SamplingParamsBody.shape).sort()).to.deep.equal([...shared, 'stop'].sort());
    const defaults = SamplingParams.parse({});
    const { stop, ...fromEmpty } = SamplingParamsBody.parse({});
    expect(stop).to.equal(undefined);
    expect(fromEmpty).to.deep.equal(Object.fromEntries(shared.map((k) => [k, defaults[k as keyof SamplingParams]])));
    // The SDK sends max_tokens null for the default.
    expect(SamplingParamsBody.parse({ max_tokens: null }).max_tokens).to.equal(defaults.max_tokens);
    for (const c of allCases.sampling.filter((x) => shared.includes(x.field))) {
      const source = SamplingParams.safeParse(c.params).success;
      const body = SamplingParamsBody.safeParse({ [c.field]: c.value }).success;
      const expected = c.field === 'max_tokens' && c.value === null ? true : source;
      expect(body, `${c.field} = ${JSON.stringify(c.value)}`).to.equal(expected);
    }
  });

  it('protocol.json carries every field with its bound and default, wherever the schema travels', () => {
    for (const kind of Object.keys(SOURCES) as Kind[]) {
      const expected = z.toJSONSchema(SOURCES[kind], { io: 'output', target: 'draft-2020-12', unrepresentable: 'any' }) as Record<string, unknown>;
      delete expected.$schema;
      for (const entry of PROTOCOL_PLACES[kind]) expect(entry).to.deep.equal(expected);
      const props = (expected as { properties: Record<string, { default?: unknown }> }).properties;
      for (const [field, value] of Object.entries(SOURCES[kind].parse({}))) expect(props[field]!.default, `${kind}.${field}`).to.deep.equal(value);
    }
  });

  it("the engines' protocol checker judges every value as the source schema does", () => {
    for (const kind of Object.keys(SOURCES) as Kind[]) {
      const verdicts = python.protocol_ok[kind];
      expect(verdicts).to.have.length(allCases[kind].length);
      allCases[kind].forEach((c, i) => {
        expect(verdicts[i], `${kind}.${c.field} = ${JSON.stringify(c.value)}`).to.equal(SOURCES[kind].safeParse(c.params).success);
      });
    }
  });

  it('the Python engines use the source fields and defaults and declare no bound of their own', () => {
    for (const kind of Object.keys(SOURCES) as Kind[]) {
      expect(python.fields[kind], kind).to.deep.equal(Object.keys(SOURCES[kind].shape));
      expect(python.defaults[kind], kind).to.deep.equal(SOURCES[kind].parse({}));
      // Values outside a bound (refused by the protocol check before an op runs) pass the engine's own parse.
      const errors = python.parse_errors[kind];
      expect(errors.length, kind).to.be.greaterThan(2);
      expect(errors.filter((e) => e !== null), kind).to.deep.equal([]);
    }
    // verl builds its optimizer with the defaults; each optim_step then applies the job's adam.
    expect(python.verl_initial_adam).to.deep.equal(AdamParams.parse({}));
  });

  it('the vLLM translation maps every sampling field', () => {
    expect(Object.keys(VLLM_SAMPLING_FIELDS).sort()).to.deep.equal(Object.keys(SamplingParams.shape).sort());
  });

  it('no other production file writes a distinctive default as a literal', () => {
    // 0.95 (beta2), 1e-12 (eps), 1e-4 (learning_rate); 256 next to max_tokens.
    const literal = /(^|[^\w.])(0\.95|1e-12|1e-4|0\.0001)(?![\w.])|max_tokens[^\n]*\b256\b|MAX_TOKENS\s*=\s*256\b/i;
    const found: string[] = [];
    for (const file of productionFiles()) {
      readFileSync(path.join(ROOT, file), 'utf8')
        .split('\n')
        .forEach((line, i) => {
          if (literal.test(line)) found.push(`${file}:${i + 1}: ${line.trim()}`);
        });
    }
    expect(found, 'declare it in queues/contract/params.ts and read it from there (Python: tinker_engine.protocol.defaults)').to.deep.equal([]);
  });
});
