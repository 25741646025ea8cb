import { readFileSync } from 'node:fs';
import { z } from 'zod';
import { invalid } from './errors.js';

/**
 * The loss catalogue (queues/contract/losses.json): names, inputs, config keys and defaults, read here by
 * the API and by the Python engines (workers/python/tinker_engine/losses.py) from the same file.
 */

const InputName = z.string().regex(/^[a-z_]+$/);
const LossEntry = z
  .object({
    inputs: z.array(InputName),
    optional_inputs: z.array(InputName),
    server_inputs: z.array(InputName),
    config: z.record(z.string(), z.number().nullable()),
    topk: z.boolean(),
  })
  .strict();
const Catalogue = z.object({ $comment: z.array(z.string()).optional(), losses: z.record(z.string(), LossEntry) }).strict();

export type LossEntry = z.infer<typeof LossEntry>;

export const LOSS_CATALOGUE_FILE = new URL('./losses.json', import.meta.url);
export const LOSSES: Readonly<Record<string, LossEntry>> = Catalogue.parse(JSON.parse(readFileSync(LOSS_CATALOGUE_FILE, 'utf8'))).losses;

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

/**
 * Checks `loss_fn_config` against the loss before the job is queued: known keys, finite numbers,
 * required keys present (the engine applies the defaults and checks again, with the same messages).
 */
export function checkLossConfig(lossFn: string, config: Record<string, number | string>): void {
  const entry = lossEntry(lossFn);
  const unknown = Object.keys(config).filter((k) => !Object.hasOwn(entry.config, k)).sort();
  if (unknown.length) {
    const accepted = Object.keys(entry.config).sort().join(', ') || 'none';
    // At most 10 named (a hostile request may send thousands), as the engine names them otherwise.
    const named = unknown.slice(0, 10).map((k) => `'${k.slice(0, 64)}'`).join(', ') + (unknown.length > 10 ? `, … (${unknown.length} in all)` : '');
    throw invalid(`loss_fn_config for '${lossFn}' has unknown keys [${named}]; accepted: ${accepted}`);
  }
  const parsed: Record<string, number> = {};
  for (const [key, dflt] of Object.entries(entry.config)) {
    const value = config[key];
    if (value === undefined) {
      if (dflt === null) throw invalid(`loss '${lossFn}' requires loss_fn_config['${key}']`);
      parsed[key] = dflt;
      continue;
    }
    const n = typeof value === 'number' || DECIMAL.test(value) ? Number(value) : NaN;
    if (!Number.isFinite(n)) throw invalid(`loss_fn_config['${key}'] must be a finite number, got ${typeof value === 'string' ? `'${value}'` : value}`);
    parsed[key] = n;
  }
  if ('clip_low_threshold' in parsed && parsed.clip_low_threshold! > parsed.clip_high_threshold!)
    throw invalid('loss_fn_config: clip_low_threshold must not exceed clip_high_threshold');
  if ((parsed.kl_coeff ?? 0) < 0) throw invalid(`loss_fn_config['kl_coeff'] must be >= 0, got ${parsed.kl_coeff}`);
}

/** A number written as text (loss_fn_config_v2 values): what Python's float() reads, less its extras. */
const DECIMAL = /^\s*[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?\s*$/;
