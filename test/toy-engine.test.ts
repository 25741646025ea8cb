import { expect } from 'chai';
import { loadAgentConfig, type BaseModelSpec } from '../queues/infra/config.js';
import type { ServedModel } from '../queues/registry/agents.js';
import { sampleEngine, type AgentRecord } from '../queues/registry/agents.js';
import type { CreateModelJob, ForwardBackwardResult, SampleJob, SampleResult } from '../queues/contract/schemas.js';
import { Preset } from '../presets/schema.js';
import type { EngineAdapter } from '../workers/adapters/adapter.js';
import { engineCatalogue, engineOf, recordCapabilities, registerEngine, unregisterEngine } from '../workers/adapters/index.js';
import { Agent } from '../workers/agent.js';
import { awaitFuture, call, startStack, type TestStack } from './helpers/stack.js';

/**
 * Adding an engine is one adapter that registers itself (workers/adapters/registry.ts). This test is
 * such an engine: it defines a toy adapter here, registers it, and nothing else changes. An agent
 * runs it against real Redis under a test prefix; the API side (the agents' records, served models,
 * sample routing, get_server_capabilities, asample) and presets pick it up with what it declares.
 */

/** The toy engine: samples (each sequence is the prompt's last token, repeated), trains nothing. */
class ToyAdapter implements EngineAdapter {
  readonly kind = 'toy';
  readonly device = 'cpu';
  async start(): Promise<void> {}
  async stop(): Promise<void> {}
  onExit(): void {}
  async loadBase(spec: BaseModelSpec): Promise<ServedModel> {
    return { name: spec.name, aliases: spec.aliases, arch: 'ToyForCausalLM', vocab_size: 100, max_context_length: 128, trainable: spec.trainable, lora_max_rank: spec.loraMaxRank, topk_max: spec.topkMax };
  }
  async sample(job: SampleJob): Promise<SampleResult> {
    const n = job.sampling_params.max_tokens;
    const seq = { tokens: Array<number>(n).fill(job.prompt.at(-1)!), logprobs: Array<number>(n).fill(0), stop_reason: 'length' as const };
    return { sequences: Array.from({ length: job.num_samples }, () => seq), prompt_logprobs: null, topk_prompt_logprobs: null };
  }
  private trainsNot(): never {
    throw new Error('the toy engine trains nothing');
  }
  async createModel(_job: CreateModelJob): Promise<{ model_id: string }> {
    return this.trainsNot();
  }
  async forwardBackward(): Promise<ForwardBackwardResult> {
    return this.trainsNot();
  }
  async optimStep(): Promise<{ metrics: Record<string, number> }> {
    return this.trainsNot();
  }
  async saveSampler(): Promise<{ size_bytes: number }> {
    return this.trainsNot();
  }
  async saveState(): Promise<{ size_bytes: number }> {
    return this.trainsNot();
  }
  async loadState(): Promise<void> {
    return this.trainsNot();
  }
  async unloadModel(): Promise<void> {}
}

describe('a toy engine registered by a test', function () {
  this.timeout(60_000);
  let s: TestStack;
  let agent: Agent;

  before(async () => {
    registerEngine({
      kind: 'toy',
      capabilities: {
        trains: false,
        samples: true,
        sampleLacks: ['prompt_alt_tokens_k'],
        sampleBatch: false,
        samplePriority: 10,
        drains: false,
        gpuOnly: false,
        placement: 'runs a model in memory',
        modelOptions: [],
      },
      create: () => new ToyAdapter(),
    });
    s = await startStack({ agent: false });
    // The agent's configuration as workers/main.ts parses it: TB_ENGINE names the toy.
    const config = loadAgentConfig(
      { REDIS_URL: process.env.REDIS_URL ?? 'redis://127.0.0.1:6379', TB_PREFIX: s.prefix, TB_STORAGE_DIR: s.storageDir, TB_AGENT_ID: `toy-${s.prefix}`, TB_AGENT_MODELS: '/models/toy=toy-base', TB_ENGINE: 'toy', TB_SAMPLE_CONCURRENCY: '2' },
      undefined,
      engineCatalogue(),
    );
    expect(config.models[0]!.trainable, 'TB_AGENT_MODELS on an engine that does not train: frozen').to.equal(false);
    agent = new Agent(config);
    await agent.start();
  });
  after(async () => {
    await agent?.stop();
    await s?.stop();
    unregisterEngine('toy');
  });

  it('is published in its agent record with the capabilities it declared', async () => {
    const records = await s.built.ctx.registry.agents.live();
    const toy = records.find((r) => r.engine === 'toy')!;
    expect(toy).to.not.equal(undefined);
    expect(toy.capabilities).to.deep.equal({ trains: false, samples: true, sample_priority: 10, drains: false });
    expect(toy.sample_lacks).to.deep.equal(['prompt_alt_tokens_k']);
    const served = (await s.built.ctx.registry.agents.servedModels()).get('/models/toy')!;
    expect(served.model).to.include({ trainable: false, vocab_size: 100 });
    expect(served.samplers.map((a) => a.engine)).to.deep.equal(['toy']);
    expect(served.trainers).to.deep.equal([]);
  });

  it('gets sample jobs by its sampling priority, and not those using what it lacks while another engine answers them', async () => {
    const records = await s.built.ctx.registry.agents.live();
    // A torch actor beside it, as a torch agent publishes itself.
    const actor: AgentRecord = { ...records[0]!, agent_id: 'actor', engine: 'torch', models: records[0]!.models.map((m) => ({ ...m, trainable: true })), ...recordCapabilities(engineOf('torch').capabilities) };
    expect(sampleEngine('/models/toy', [actor, ...records], null)).to.equal('toy');
    expect(sampleEngine('/models/toy', [actor, ...records], null, ['prompt_alt_tokens_k'])).to.equal('torch');
  });

  it('serves asample through the API, says what it serves in get_server_capabilities, and refuses what it lacks', async () => {
    const caps = await call(s.baseUrl, 'GET', '/get_server_capabilities');
    expect(caps.json.supported_models).to.deep.include({ model_name: '/models/toy', max_context_length: 128, trainable: false, sampleable: true });
    const body = { base_model: 'toy-base', num_samples: 2, prompt: { chunks: [{ tokens: [4, 7] }] }, sampling_params: { max_tokens: 3 } };
    const sub = await call(s.baseUrl, 'POST', '/asample', body);
    expect(sub.status, JSON.stringify(sub.json)).to.equal(200);
    const out = (await awaitFuture(s.baseUrl, sub.json.request_id)).json;
    expect(out.sequences.map((q: { tokens: number[] }) => q.tokens)).to.deep.equal([[7, 7, 7], [7, 7, 7]]);
    // Only the toy serves the model: the job comes to it, and its agent refuses it as the registration says.
    const alt = await call(s.baseUrl, 'POST', '/asample', { ...body, prompt_alt_tokens_k: 2 });
    const refused = (await awaitFuture(s.baseUrl, alt.json.request_id)).json;
    expect(refused).to.include({ category: 'user' });
    expect(refused.error).to.match(/^prompt_alt_tokens_k is not supported by the toy engine/);
  });

  it('is a preset engine: presets accept it and check its fields as it declared', () => {
    const preset = (engine: string, tensor = 1) => Preset.safeParse({ name: 't', models: [{ name: 'a', path: '/m/a', role: 'teacher', engine, parallelism: { tensor } }], agents: [{ id: 'g', models: ['a'] }] });
    expect(preset('toy').success).to.equal(true);
    const split = preset('toy', 2);
    expect(split.success).to.equal(false);
    expect(split.error!.issues.map((i) => i.message)).to.deep.equal(["tensor parallelism applies to engine 'vllm'; engine 'toy' runs a model in memory"]);
  });
});
