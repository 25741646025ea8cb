import { readFileSync } from 'node:fs';
import { z } from 'zod';
import { invalid } from './errors.js';

/**
 * The loss catalogue (queues/contract/losses.json): every rule about a loss, as data. The API reads
 * it here; the engines read the same file (workers/python/tinker_engine/losses.py). The checkers
 * below are generic: no loss is named in code. The file's $comment says what each field means.
 */

const Name = z.string().regex(/^[a-z_]+$/);
const ConfigKey = z.object({ default: z.number().nullable(), at_least: z.number().optional(), above: z.number().optional() }).strict();
const DatumRule = z.union([
  z.object({ some_nonzero: Name, message: z.string() }).strict(),
  z.object({ zero_outside: Name, mask: Name, message: z.string() }).strict(),
]);
const LossEntry = z
  .object({
    inputs: z.array(Name),
    optional_inputs: z.array(Name),
    server_inputs: z.array(Name),
    provenance: z.boolean(),
    topk: z.boolean(),
    config: z.record(Name, ConfigKey),
    ordered: z.array(z.tuple([Name, Name])),
    datum_rules: z.array(DatumRule),
  })
  .strict()
  .superRefine((e, ctx) => {
    const inputs = [...e.inputs, ...e.optional_inputs, ...e.server_inputs];
    for (const pair of e.ordered)
      for (const k of pair) if (!Object.hasOwn(e.config, k)) ctx.addIssue({ code: 'custom', message: `ordered names '${k}', not a config key` });
    for (const r of e.datum_rules)
      for (const k of ruleInputs(r)) if (!inputs.includes(k)) ctx.addIssue({ code: 'custom', message: `a datum rule reads '${k}', not an input` });
    // The server inputs are what provenance resolution adds (api/stability.ts): one goes with the other.
    if (e.provenance !== e.server_inputs.length > 0) ctx.addIssue({ code: 'custom', message: 'provenance and server_inputs go together' });
  });
const Catalogue = z
  .object({ $comment: z.array(z.string()).optional(), config_number_text: z.string(), losses: z.record(Name, LossEntry) })
  .strict();

export type LossEntry = z.infer<typeof LossEntry>;
type DatumRule = z.infer<typeof DatumRule>;
/** A loss input as the checks read it: its shape and its values, flat. */
type InputValues = { shape: number[]; data: number[] };

function ruleInputs(r: DatumRule): string[] {
  return 'some_nonzero' in r ? [r.some_nonzero] : [r.zero_outside, r.mask];
}

export const LOSS_CATALOGUE_FILE = new URL('./losses.json', import.meta.url);
const CATALOGUE = Catalogue.parse(JSON.parse(readFileSync(LOSS_CATALOGUE_FILE, 'utf8')));
export const LOSSES: Readonly<Record<string, LossEntry>> = CATALOGUE.losses;
/** A loss_fn_config value written as text (loss_fn_config_v2): a decimal number, as both checkers read it. */
const NUMBER_TEXT = new RegExp(`^(?:${CATALOGUE.config_number_text})$`);

/** What a client may send in loss_fn_inputs for each loss (target_tokens is required by every loss). */
export const LOSS_INPUTS: Readonly<Record<string, { required: string[]; optional: string[] }>> = Object.fromEntries(
  Object.entries(LOSSES).map(([name, l]) => [name, { required: ['target_tokens', ...l.inputs], optional: l.optional_inputs }]),
);

/** The loss's catalogue entry, or the user error naming the supported ones. */
export function lossEntry(lossFn: string): LossEntry {
  const entry = Object.hasOwn(LOSSES, lossFn) ? LOSSES[lossFn] : undefined;
  if (!entry) throw invalid(`unknown loss_fn '${lossFn}'; supported: ${Object.keys(LOSSES).join(', ')}`);
  return entry;
}

/** The loss_fn_inputs a client may send for the loss, or the user error naming the supported losses. */
export function lossInputs(lossFn: string): { required: string[]; optional: string[] } {
  lossEntry(lossFn);
  return LOSS_INPUTS[lossFn]!;
}

/** The bound that one of `values` breaks, as the message says it (`>= 0`), or null. */
function brokenBound(key: { at_least?: number; above?: number }, values: number[]): string | null {
  if (key.at_least !== undefined && values.some((v) => v < key.at_least!)) return `>= ${key.at_least}`;
  if (key.above !== undefined && values.some((v) => v <= key.above!)) return `> ${key.above}`;
  return null;
}

/** Whether a datum may replace the config key with its own per-token values. */
function perToken(entry: LossEntry, key: string): boolean {
  return entry.optional_inputs.includes(key);
}

/**
 * Checks `loss_fn_config` against the loss before the job is queued, and returns it with the
 * defaults applied: known keys, finite numbers, required keys present, bounds of the keys a datum
 * cannot replace, `ordered` pairs. The engine applies the same rules, with the same messages.
 */
export function checkLossConfig(lossFn: string, config: Record<string, number | string>): Record<string, number> {
  const entry = lossEntry(lossFn);
  const unknown = Object.keys(config).filter((k) => !Object.hasOwn(entry.config, k)).sort();
  if (unknown.length) {
    const accepted = Object.keys(entry.config).sort().join(', ') || 'none';
    // At most 10 named (a hostile request may send thousands).
    const named = unknown.slice(0, 10).map((k) => `'${k.slice(0, 64)}'`).join(', ') + (unknown.length > 10 ? `, … (${unknown.length} in all)` : '');
    throw invalid(`loss_fn_config for '${lossFn}' has unknown keys [${named}]; accepted: ${accepted}`);
  }
  const parsed: Record<string, number> = {};
  for (const [key, spec] of Object.entries(entry.config)) {
    const value = config[key];
    if (value === undefined) {
      if (spec.default === null) throw invalid(`loss '${lossFn}' requires loss_fn_config['${key}']`);
      parsed[key] = spec.default;
      continue;
    }
    const n = typeof value === 'number' || NUMBER_TEXT.test(value) ? Number(value) : NaN;
    if (!Number.isFinite(n)) throw invalid(`loss_fn_config['${key}'] must be a finite number, got ${typeof value === 'string' ? `'${value}'` : value}`);
    parsed[key] = n;
  }
  for (const [key, spec] of Object.entries(entry.config)) {
    const broken = perToken(entry, key) ? null : brokenBound(spec, [parsed[key]!]);
    if (broken) throw invalid(`loss_fn_config['${key}'] must be ${broken}, got ${parsed[key]}`);
  }
  for (const [a, b] of entry.ordered)
    if (parsed[a]! > parsed[b]!) throw invalid(`loss_fn_config: ${a} must not exceed ${b}`);
  return parsed;
}

/**
 * The catalogue's checks of one datum's input values, given the parsed config (what the engine
 * checks): the bounds and `ordered` pairs of the keys the datum may give per token (on the values
 * it uses: its own, else the config's), then the datum rules. The error starts with `where`.
 */
export function checkDatum(lossFn: string, inputs: Readonly<Record<string, InputValues | undefined>>, config: Readonly<Record<string, number>>, where: string): void {
  const entry = lossEntry(lossFn);
  const used = (key: string) => inputs[key]?.data ?? [config[key]!];
  for (const [key, spec] of Object.entries(entry.config)) {
    const broken = perToken(entry, key) ? brokenBound(spec, used(key)) : null;
    if (broken) throw invalid(`${where}: ${key} must be ${broken}`);
  }
  for (const [a, b] of entry.ordered) {
    if (!perToken(entry, a) && !perToken(entry, b)) continue;
    const lo = used(a);
    const hi = used(b);
    for (let i = 0; i < Math.max(lo.length, hi.length); i++)
      if (lo[lo.length === 1 ? 0 : i]! > hi[hi.length === 1 ? 0 : i]!) throw invalid(`${where}: ${a} exceeds ${b}`);
  }
  checkDatumRules(entry.datum_rules, inputs, where);
}

/**
 * The catalogue's datum rules that read a server input, on a datum the API has just added its
 * server inputs to (what the API checks before queueing; the engine checks them again).
 */
export function checkServerInputs(lossFn: string, inputs: Readonly<Record<string, InputValues | undefined>>, where: string): void {
  const entry = lossEntry(lossFn);
  const rules = entry.datum_rules.filter((r) => ruleInputs(r).some((k) => entry.server_inputs.includes(k)));
  checkDatumRules(rules, inputs, where);
}

function checkDatumRules(rules: DatumRule[], inputs: Readonly<Record<string, InputValues | undefined>>, where: string): void {
  for (const rule of rules) {
    if ('some_nonzero' in rule) {
      const values = inputs[rule.some_nonzero]?.data;
      if (values && !values.some((v) => v !== 0)) throw invalid(`${where}: ${rule.message}`);
      continue;
    }
    const values = inputs[rule.zero_outside];
    const mask = inputs[rule.mask]?.data;
    if (!values || !mask) continue;
    const at = values.data.findIndex((v, i) => v !== 0 && mask[i] === 0);
    if (at < 0) continue;
    // The position is the token: the row of an (N, K) input.
    const position = values.shape.length > 1 ? Math.floor(at / values.shape[1]!) : at;
    throw invalid(`${where}: ${rule.message.replace('{position}', String(position)).replace('{value}', String(values.data[at]))}`);
  }
}
