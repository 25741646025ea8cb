import { invalid } from '../queues/contract/errors.js';
import { checkServerInputs } from '../queues/contract/losses.js';
import type { ModelRecord } from '../queues/registry/models.js';
import type { Datum } from '../queues/contract/schemas.js';
import { useStabilityRecords, type StabilityRecord } from '../queues/runtime/stability.js';
import type { ApiContext } from './context.js';
import type { DatumProvenance, ProvenanceSpan } from './wire/proto.js';

/**
 * For a loss with `provenance` in the loss catalogue (stable_reinforce): resolve each datum's
 * provenance spans against the stability records the sampler wrote (queues/runtime/stability.ts),
 * check that the datum's tokens are the recorded ones (the model input everywhere, the targets
 * where they are sampled tokens), and add the engine's inputs `stability_logprobs` (the recorded
 * sampler logprob at each sampled target position, 0 elsewhere) and `stability_mask` (1 at those
 * positions): the loss's `server_inputs`. Then the catalogue's datum rules that read them are
 * checked. Every refusal names the datum and position.
 */

type Run = { span: ProvenanceSpan; rec: StabilityRecord };

function tile(spans: ProvenanceSpan[], n: number, what: string): void {
  const total = spans.reduce((a, s) => a + s.length, 0);
  if (total !== n) throw invalid(`${what} cover ${total} positions but the field has ${n}; the runs must tile it exactly`);
}

/**
 * Walks the runs of `spans` over `values`, checking each value against the record. With
 * `promptValuesFree`, values under a prompt span are not checked: targets there are not scored
 * (the loss takes advantages on sampled tokens only), and the cookbook's rl_loop pads them
 * with 0 rather than repeating the prompt.
 */
function walk(values: number[], spans: ProvenanceSpan[], recs: Map<string, StabilityRecord>, what: string, visit?: (pos: number, run: Run, k: number) => void, promptValuesFree = false): void {
  let pos = 0;
  for (const span of spans) {
    const rec = recs.get(span.sequence_id)!;
    const source = span.kind === 'prompt' ? rec.prompt : rec.tokens;
    const label = span.kind === 'prompt' ? 'prompt' : 'sampled tokens';
    if (span.offset + span.length > source.length)
      throw invalid(`${what}: span [${span.offset}, ${span.offset + span.length}) of sequence '${span.sequence_id}' is outside its ${label} (${source.length} tokens)`);
    const free = promptValuesFree && span.kind === 'prompt';
    for (let k = 0; k < span.length; k++) {
      const want = source[span.offset + k]!;
      if (!free && values[pos] !== want)
        throw invalid(`${what}: position ${pos} is token ${values[pos]}, but its provenance (${label} of sequence '${span.sequence_id}', offset ${span.offset + k}) recorded ${want}`);
      visit?.(pos, { span, rec }, k);
      pos++;
    }
  }
}

export async function attachStability(ctx: ApiContext, model: ModelRecord, lossFn: string, data: Datum[], provenance: DatumProvenance[]): Promise<void> {
  const ids = new Set<string>();
  data.forEach((d, i) => {
    const p = provenance[i];
    if (!p)
      throw invalid(
        `data[${i}]: loss_fn '${lossFn}' needs provenance on every datum: sample with record_stability_info=True and ` +
          `attach the sequences' sequence_ids with Datum.with_provenance`,
      );
    tile(p.model_input, d.tokens.length, `data[${i}].model_input_spans`);
    tile(p.loss_fn_inputs, d.loss_fn_inputs.target_tokens!.data.length, `data[${i}].loss_fn_input_spans`);
    for (const s of [...p.model_input, ...p.loss_fn_inputs]) ids.add(s.sequence_id);
  });
  const found = await useStabilityRecords(ctx.redis, ctx.names, [...ids]);
  const recs = new Map<string, StabilityRecord>();
  for (const [id, rec] of found) {
    if (!rec)
      throw invalid(
        `${lossFn}: sequence '${id}' has no stability record: sample it with record_stability_info=True ` +
          `(records live one day after sampling, restarted by each training request that uses them)`,
      );
    if (rec.session_id !== null && rec.session_id !== model.session_id)
      throw invalid(`${lossFn}: sequence '${id}' was sampled in session ${rec.session_id}; model ${model.model_id} belongs to session ${model.session_id}`);
    recs.set(id, rec);
  }
  data.forEach((d, i) => {
    const p = provenance[i]!;
    walk(d.tokens, p.model_input, recs, `data[${i}].model_input`);
    const target = d.loss_fn_inputs.target_tokens!;
    const n = target.data.length;
    const q = new Array<number>(n).fill(0);
    const mask = new Array<number>(n).fill(0);
    walk(target.data, p.loss_fn_inputs, recs, `data[${i}].target_tokens`, (pos, run, k) => {
      if (run.span.kind !== 'sampled') return;
      q[pos] = run.rec.logprobs[run.span.offset + k]!;
      mask[pos] = 1;
    }, true);
    d.loss_fn_inputs.stability_logprobs = { dtype: 'float32', shape: [n], data: q };
    d.loss_fn_inputs.stability_mask = { dtype: 'float32', shape: [n], data: mask };
    checkServerInputs(lossFn, d.loss_fn_inputs, `data[${i}]`);
  });
}
