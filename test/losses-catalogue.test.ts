import { spawnSync } from 'node:child_process';
import { readFileSync } from 'node:fs';
import path from 'node:path';
import { expect } from 'chai';
import { BrokerError } from '../queues/contract/errors.js';
import { checkLossConfig, LOSS_INPUTS, LOSSES } from '../queues/contract/losses.js';

/**
 * The loss catalogue (queues/contract/losses.json) is read by the API and by the Python engine: both
 * readers are compared here, field by field, with the engine's own view of it (its LossSpec
 * table, loaded by the engine's import), and the API's config check is compared with the
 * engine's, message by message, so that neither side can drift from the other or from the docs.
 * test/one-source-losses.test.ts compares both checkers on cases made from the catalogue itself.
 */
const PYTHON = path.resolve('.venv/bin/python');

function python(code: string, input = ''): any {
  const r = spawnSync(PYTHON, ['-c', code], { cwd: 'workers/python', encoding: 'utf8', input });
  expect(r.status, r.stderr).to.equal(0);
  return JSON.parse(r.stdout);
}

function apiError(lossFn: string, config: Record<string, number | string>): string | null {
  try {
    checkLossConfig(lossFn, config);
    return null;
  } catch (e) {
    expect(e).to.be.instanceOf(BrokerError);
    return (e as Error).message;
  }
}

describe('the loss catalogue, shared by the API and the engine', function () {
  this.timeout(60_000);

  it('the engine implements exactly the catalogue\'s losses, with its inputs, config defaults and target shapes', () => {
    const engine = python(`
import json
from tinker_engine.losses import LOSSES
print(json.dumps({n: {"required": list(s.required_inputs), "optional": list(s.optional_inputs),
                      "config": dict(s.config), "bounds": {k: dict(b) for k, b in s.bounds.items()},
                      "ordered": [list(p) for p in s.ordered], "datum_rules": [dict(r) for r in s.datum_rules],
                      "topk": s.allows_topk} for n, s in LOSSES.items()}))`);
    expect(Object.keys(engine).sort()).to.deep.equal(Object.keys(LOSSES).sort());
    for (const [name, entry] of Object.entries(LOSSES)) {
      expect(engine[name], name).to.deep.equal({
        required: [...entry.inputs, ...entry.server_inputs],
        optional: entry.optional_inputs,
        config: Object.fromEntries(Object.entries(entry.config).map(([k, c]) => [k, c.default])),
        bounds: Object.fromEntries(
          Object.entries(entry.config)
            .map(([k, { default: _d, ...b }]): [string, object] => [k, b])
            .filter(([, b]) => Object.keys(b).length),
        ),
        ordered: entry.ordered,
        datum_rules: entry.datum_rules,
        topk: entry.topk,
      });
      // What a client may send: target_tokens, the inputs, the optional ones; never a server input.
      expect(LOSS_INPUTS[name]).to.deep.equal({ required: ['target_tokens', ...entry.inputs], optional: entry.optional_inputs });
      for (const k of entry.server_inputs) expect([...LOSS_INPUTS[name]!.required, ...LOSS_INPUTS[name]!.optional]).to.not.include(k);
    }
  });

  it('every loss and every config default is in docs/losses.md', () => {
    const doc = readFileSync('docs/losses.md', 'utf8');
    for (const [name, entry] of Object.entries(LOSSES)) {
      const row = doc.split('\n').find((l) => l.startsWith(`| \`${name}\``));
      expect(row, `docs/losses.md has a table row for ${name}`).to.be.a('string');
      for (const [key, { default: dflt }] of Object.entries(entry.config)) {
        const d = dflt === null ? 'required' : String(dflt).replace('.', '\\.');
        expect(row, `${name}'s row gives ${key}'s default ${dflt}`).to.match(new RegExp(`\`${key}\` \\(${d}(\\.0)?( = [^)]*)?\\)`));
      }
    }
  });

  // Each config is sent to the API's check and to the engine's parse_config: both accept it, or
  // both refuse it with the same message (the API refuses before queueing; the engine re-checks).
  const CASES: [string, Record<string, number | string>][] = [
    ['ppo', {}],
    ['ppo', { clip_low_threshold: 0.5 }],
    ['ppo', { clip_low_threshold: '0.5', clip_high_threshold: '2' }],
    ['ppo', { clip_low_threshold: 2 }],
    ['ppo', { epsilon: 0.2 }],
    ['ppo', { clip_high_threshold: 'wide' }],
    ['ppo', { clip_high_threshold: '0x10' }],
    ['cross_entropy', { beta: 1 }],
    ['dro', {}],
    ['dro', { beta: 0.1 }],
    ['gspo', { clip_low_threshold: 0.99, clip_high_threshold: 1.01 }],
    ['stable_reinforce', { kl_coeff: -1 }],
    ['stable_reinforce', { kl_coeff: '0.01' }],
    ['stable_reinforce', { kl_coeff: 'nan' }],
    ['stable_reinforce', { clip_low_threshold: 0.5 }],
  ];

  it('refuses the same loss_fn_config as the engine, with the same message', () => {
    const engine: (string | null)[] = python(`
import json
from tinker_engine.errors import UserError
from tinker_engine.losses import get_loss
out = []
for name, config in ${JSON.stringify(CASES)}:
    try:
        get_loss(name).parse_config(config)
        out.append(None)
    except UserError as e:
        out.append(str(e))
print(json.dumps(out))`);
    CASES.forEach(([name, config], i) => {
      const api = apiError(name, config);
      expect(api, `${name} ${JSON.stringify(config)}`).to.equal(engine[i]);
    });
    expect(engine.filter((e) => e === null).length, 'some configs are accepted').to.be.at.least(5);
    // A hostile config with thousands of keys: the message names ten, and how many there were.
    const many = Object.fromEntries(Array.from({ length: 5000 }, (_, i) => [`k${String(i).padStart(4, '0')}${'x'.repeat(200)}`, 1]));
    const message = apiError('ppo', many)!;
    expect(message).to.match(/has unknown keys \['k0000x+', .*, … \(5000 in all\)\]; accepted: clip_high_threshold, clip_low_threshold$/);
    expect(message.length).to.be.below(1200);
    const engineMessage = python(`
import json, sys
from tinker_engine.errors import UserError
from tinker_engine.losses import get_loss
try:
    get_loss("ppo").parse_config(json.load(sys.stdin))
except UserError as e:
    print(json.dumps(str(e)))`, JSON.stringify(many));
    expect(engineMessage).to.equal(message);
    expect(engine.filter((e) => e !== null).length, 'some configs are refused').to.be.at.least(7);
  });
});
