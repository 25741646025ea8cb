import { spawnSync } from 'node:child_process';
import { mkdtempSync, readdirSync, readFileSync, writeFileSync } from 'node:fs';
import { createServer } from 'node:net';
import os from 'node:os';
import path from 'node:path';
import { expect } from 'chai';
import { loadPreset } from '../presets/schema.js';
import { loadAgentConfig } from '../queues/infra/config.js';
import { logger } from '../queues/infra/logger.js';
import { Agent } from '../workers/agent.js';

/** Presets: every shipped preset validates and plans (--dry-run); a bad one stops before anything starts. */
function cli(...args: string[]) {
  return spawnSync(process.execPath, ['--import', 'tsx', 'scripts/tinker-broker.ts', ...args], { encoding: 'utf8', env: { ...process.env, TB_LOG_LEVEL: 'warn' } });
}

const shipped = readdirSync('presets', { withFileTypes: true })
  .filter((d) => d.isDirectory())
  .flatMap((d) => readdirSync(path.join('presets', d.name)).filter((f) => f.endsWith('.yaml')).map((f) => path.join('presets', d.name, f)));

describe('presets', function () {
  this.timeout(60_000);
  const tmp = mkdtempSync(path.join(os.tmpdir(), 'tb-presets-'));
  const write = (name: string, text: string) => {
    const f = path.join(tmp, name);
    writeFileSync(f, text);
    return f;
  };

  it('the command line exits 0 quietly when its reader goes away (| head): no EPIPE crash', () => {
    // `head -c 0` exits before reading: every write the command makes meets a closed pipe.
    const r = spawnSync('bash', ['-c', `'${process.execPath}' --import tsx scripts/tinker-broker.ts --help | head -c 0; echo "rc=\${PIPESTATUS[0]}"`], { encoding: 'utf8' });
    expect(r.stdout.trim()).to.equal('rc=0');
    expect(r.stderr).to.not.match(/EPIPE|Unhandled/);
  });

  it('ships the quick_start, distill and cpu presets', () => {
    expect(shipped).to.include.members([
      'presets/quick_start/actor.yaml',
      'presets/quick_start/actor_rollout.yaml',
      'presets/quick_start/actor_rollout_ref.yaml',
      'presets/distill/single_teacher.yaml',
      'presets/distill/multi_teacher.yaml',
      'presets/cpu/tiny.yaml',
    ]);
  });

  it('plans every preset on every node with --dry-run', function () {
    this.timeout(300_000); // one CLI process per preset and node, a few seconds each on a loaded machine
    for (const file of shipped) {
      const { preset } = loadPreset(file);
      const nodes = [...new Set([preset.api.node, ...preset.agents.map((a) => a.node)])];
      const placed = new Set<string>();
      for (const node of nodes) {
        const r = cli('start', '--preset', file, '--node', node, '--dry-run', '--json');
        expect(r.status, `${file} --node ${node}: ${r.stderr}`).to.equal(0);
        const plan = JSON.parse(r.stdout);
        expect(plan.node).to.equal(node);
        for (const a of plan.agents) placed.add(a.agentId);
        if (node === preset.api.node) expect(plan.api.requiredModels).to.deep.equal(preset.models.map((m) => m.name));
      }
      // Each agent starts on exactly its node.
      expect([...placed].sort(), file).to.deep.equal(preset.agents.map((a) => a.id).sort());
    }
  });

  it('merges models of one path into one loaded model with aliases and the roles of each', () => {
    const plan = JSON.parse(cli('start', '--preset', 'presets/quick_start/actor_rollout_ref.yaml', '--agent', 'gpu3', '--dry-run', '--json').stdout);
    expect(plan.api.requiredModels).to.include('Qwen/Qwen3-1.7B-ref');
    expect(plan.agents).to.have.length(1);
    expect(plan.agents[0].models[0]).to.include({ trainable: false, topkMax: 20 });
  });

  it('rejects an invalid preset before starting anything, naming each bad field', () => {
    const bad = write(
      'bad.yaml',
      `name: bad
models:
  - { name: a, path: /m/a, role: student }
  - { name: b, path: /m/b, role: teacher, engine: tensorflow }
agents:
  - { id: g0, device: "cuda:0", models: [a, c] }
  - { id: g1, device: "cuda:0,1", models: [b] }
`,
    );
    const r = cli('start', '--preset', bad);
    expect(r.status).to.equal(2);
    expect(r.stderr).to.include(`invalid preset ${bad}`);
    expect(r.stderr).to.match(/models\[0\]\.role: Invalid option/);
    expect(r.stderr).to.match(/models\[1\]\.engine: Invalid option/);
    expect(r.stdout).to.equal('');
    // Cross-references are checked once every field is well formed.
    const refs = write(
      'refs.yaml',
      `name: refs\nmodels:\n  - { name: a, path: /m/a, role: actor }\n  - { name: b, path: /m/b, role: teacher }\nagents:\n  - { id: g0, device: "cuda:0", models: [a, c] }\n  - { id: g1, device: "cuda:0,1", models: [b] }\n`,
    );
    const r2 = cli('start', '--preset', refs, '--dry-run');
    expect(r2.status).to.equal(2);
    expect(r2.stderr).to.match(/agents\[0\]\.models\[1\]: unknown model 'c'/);
    expect(r2.stderr).to.match(/agents\[0\]\.device: GPU 0 of node 'local' is shared by agents 'g0', 'g1': set gpu_memory on each of them/);
    expect(r2.stderr).to.match(/agents\[1\]\.device: GPU 0 of node 'local' is shared by agents 'g0', 'g1'/);
    expect(r2.stdout).to.equal('');
  });

  it('lets agents share a GPU only with their shares set: fitting together, or taking turns', () => {
    const preset = (agents: string) =>
      `name: share\nmodels:\n  - { name: a, path: /m/a, role: actor }\n  - { name: r, path: /m/a, role: rollout, engine: vllm }\n  - { name: v, path: /m/v, role: actor, engine: verl }\nagents:\n${agents}`;
    const refused = (agents: string) => {
      const r = cli('start', '--preset', write('share.yaml', preset(agents)), '--dry-run');
      expect(r.status, r.stdout).to.equal(2);
      return r.stderr;
    };
    const accepted = (agents: string) => {
      const r = cli('start', '--preset', write('share.yaml', preset(`${agents}  - { id: v0, device: "cuda:3", models: [v] }\n`)), '--dry-run', '--json');
      expect(r.status, r.stderr).to.equal(0);
      return JSON.parse(r.stdout);
    };
    // Shares that fit the GPU together: a fixed split.
    let plan = accepted(`  - { id: t, device: "cuda:0", models: [a], gpu_memory: 0.5 }\n  - { id: r, device: "cuda:0", models: [r], gpu_memory: 0.4 }\n`);
    expect(plan.agents.map((x: { agentId: string; gpuMemory?: number; gpuTurns?: unknown }) => [x.agentId, x.gpuMemory, x.gpuTurns ?? null])).to.deep.equal([
      ['t', 0.5, null],
      ['r', 0.4, null],
      ['v0', undefined, null],
    ].map(([id, m, t]) => (m === undefined ? [id, undefined, t] : [id, m, t])));
    // More than the GPU: refused unless they take turns; with turns each agent gets the GPU's key.
    expect(refused(`  - { id: t, device: "cuda:0", models: [a], gpu_memory: 0.7 }\n  - { id: r, device: "cuda:0", models: [r], gpu_memory: 0.6 }\n`)).to.match(
      /agents\[1\]\.gpu_memory: GPU 0 of node 'local': the gpu_memory of agents 't', 'r' add up to 1\.3, more than the GPU; lower them, or set take_turns on each/,
    );
    plan = accepted(`  - { id: t, device: "cuda:0", models: [a], gpu_memory: 0.7, take_turns: true }\n  - { id: r, device: "cuda:0", models: [r], gpu_memory: 0.6, take_turns: true }\n`);
    expect(plan.agents.slice(0, 2).map((x: { gpuTurns: { gpu: string } }) => x.gpuTurns.gpu)).to.deep.equal(['local/0', 'local/0']);
    expect(plan.layout.slice(0, 2).map((x: { gpu: string }) => x.gpu)).to.deep.equal(['0.7, turns', '0.6, turns']);
    // Turns are all or none; a share without a GPU is refused; verl does not take turns.
    expect(refused(`  - { id: t, device: "cuda:0", models: [a], gpu_memory: 0.5, take_turns: true }\n  - { id: r, device: "cuda:0", models: [r], gpu_memory: 0.4 }\n`)).to.match(
      /agents\[1\]\.take_turns: GPU 0 of node 'local' is shared by agents 't', 'r': either all of them take turns or none/,
    );
    expect(refused(`  - { id: t, device: cpu, models: [a], gpu_memory: 0.5 }\n  - { id: r, device: cpu, models: [r] }\n  - { id: v0, device: "cuda:3", models: [v], take_turns: true }\n`))
      .to.match(/agents\[0\]\.gpu_memory: gpu_memory applies to an agent on GPUs; agent 't' runs on cpu/)
      .and.to.match(/agents\[2\]\.take_turns: engine 'verl' does not take turns on a GPU in this version \(torch and vllm do\)/);
    // A vLLM agent's sleep level needs turns and vLLM; random weights (load_format: dummy) are vLLM's only.
    expect(refused(`  - { id: t, device: "cuda:0", models: [a], gpu_memory: 0.5, take_turns: true, sleep_level: 2 }\n  - { id: r, device: "cuda:1", models: [r], sleep_level: 2 }\n`))
      .to.match(/agents\[0\]\.sleep_level: sleep_level applies to engine 'vllm' \(its sleep mode\), not engine 'torch'/)
      .and.to.match(/agents\[1\]\.sleep_level: sleep_level applies to an agent that takes turns/);
    plan = accepted(`  - { id: t, device: "cuda:0", models: [a], gpu_memory: 0.7, take_turns: true }\n  - { id: r, device: "cuda:0", models: [r], gpu_memory: 0.6, take_turns: true, sleep_level: 2 }\n`);
    expect(plan.agents[1].vllm.sleepLevel).to.equal(2);
    // Co-batching is the torch engine's: the plan carries its bounds; another engine is told.
    plan = accepted(`  - { id: t, device: "cuda:0", models: [a], cobatch: { max: 4, wait_ms: 50 } }\n  - { id: r, device: "cuda:1", models: [r] }\n`);
    // The vLLM agent keeps the agent default (4), which an engine without co-batching runs one op at a time.
    expect([plan.agents[0].cobatchMax, plan.agents[0].cobatchWaitMs, plan.agents[1].cobatchMax]).to.deep.equal([4, 50, 4]);
    expect(refused(`  - { id: t, device: "cuda:0", models: [a] }\n  - { id: r, device: "cuda:1", models: [r], cobatch: { max: 4 } }\n  - { id: x, device: "cuda:2", models: [a], cobatch: { max: 4, wait_ms: 5000 } }\n`))
      .to.match(/agents\[1\]\.cobatch: cobatch applies to engine 'torch', not engine 'vllm'/)
      .and.to.match(/agents\[2\]\.cobatch\.wait_ms/);
    const dummy = (engine: string) =>
      cli('start', '--preset', write('dummy.yaml', `name: d\nmodels:\n  - { name: m, path: /m/a, role: teacher, engine: ${engine}, load_format: dummy }\nagents:\n  - { id: g, device: "cuda:0", models: [m] }\n`), '--dry-run', '--json');
    expect(JSON.parse(dummy('vllm').stdout).agents[0].models[0].loadFormat).to.equal('dummy');
    expect(dummy('torch').stderr).to.match(/models\[0\]\.load_format: load_format applies to engine 'vllm', not engine 'torch'/);
    // Agents on different nodes share nothing.
    accepted(`  - { id: t, node: n0, device: "cuda:0", models: [a] }\n  - { id: r, node: n1, device: "cuda:0", models: [r] }\n`);
  });

  it('rejects unknown keys and unserved models', () => {
    const r = cli(
      'validate',
      write('typo.yaml', `name: t\nmodels:\n  - { name: a, path: /m/a, role: actor, lora_rank_max: 8 }\n  - { name: b, path: /m/b, role: teacher }\nagents:\n  - { id: g0, models: [a] }\n`),
    );
    expect(r.status).to.equal(2);
    expect(r.stderr).to.match(/models\[0\]: Unrecognized key: "lora_rank_max"/);
    expect(r.stderr).to.match(/models\[1\]\.name: model 'b' is served by no agent/);
  });

  it('refuses the fields a model\'s engine would ignore, naming each, and accepts those it uses', () => {
    const r = cli(
      'validate',
      write(
        'ignored.yaml',
        `name: t
models:
  - { name: a, path: /m/a, role: actor, offload: true, remove_padding: true, gradient_checkpointing: false, parallelism: { tensor: 2, pipeline: 2, data: 2, expert: 2, strategy: fsdp2 } }
  - { name: b, path: /m/b, role: teacher, engine: vllm, parallelism: { tensor: 4, expert: 2 } }
  - { name: c, path: /m/c, role: actor, engine: verl, parallelism: { data: 4, strategy: fsdp } }
agents:
  - { id: g0, device: cuda:0, models: [a] }
  - { id: g1, device: "cuda:1,2,3,4", models: [b] }
  - { id: g2, device: "cuda:5,6", models: [c] }
`,
      ),
    );
    expect(r.status).to.equal(2);
    const lines = r.stderr.trim().split('\n').slice(1);
    expect(lines, r.stderr).to.have.length(10);
    expect(r.stderr).to.match(/models\[0\]\.parallelism\.pipeline: pipeline parallelism is not available/);
    expect(r.stderr).to.match(/models\[0\]\.parallelism\.tensor: tensor parallelism applies to engine 'vllm'; engine 'torch' runs a model on one device/);
    expect(r.stderr).to.match(/models\[0\]\.parallelism\.expert: expert parallelism applies to engine 'vllm', not engine 'torch'/);
    expect(r.stderr).to.match(/models\[0\]\.parallelism\.data: data parallelism applies to engine 'verl', not engine 'torch'/);
    expect(r.stderr).to.match(/models\[0\]\.parallelism\.strategy: strategy applies to engine 'verl'/);
    expect(r.stderr).to.match(/models\[0\]\.offload: offload applies to engine 'verl'/);
    expect(r.stderr).to.match(/models\[0\]\.remove_padding: remove_padding applies to engine 'verl', not engine 'torch'/);
    expect(r.stderr).to.match(/models\[0\]\.gradient_checkpointing: gradient_checkpointing applies to engine 'verl', not engine 'torch'/);
    expect(r.stderr).to.match(/models\[1\]\.parallelism\.expert: vLLM runs the experts over the tensor-parallel GPUs: expert is 1 \(off\) or equal to tensor \(4\), got 2/);
    expect(r.stderr).to.match(/models\[2\]\.parallelism\.data: data 4, but agent 'g2' runs this model on 2 GPU\(s\) \(cuda:5,6\)/);
    // verl's VeOmni strategy keeps padding: a model asking for it removed is told so.
    const veomni = cli('validate', write('veomni.yaml', `name: t\nmodels:\n  - { name: c, path: /m/c, role: actor, engine: verl, remove_padding: true, parallelism: { strategy: veomni } }\nagents:\n  - { id: g2, device: cuda, models: [c] }\n`));
    expect(veomni.status).to.equal(2);
    expect(veomni.stderr).to.match(/models\[0\]\.remove_padding: verl's veomni strategy keeps padding in this version \(fsdp2 and fsdp remove it\)/);
    const megatron = cli('validate', write('megatron.yaml', `name: t\nmodels:\n  - { name: c, path: /m/c, role: actor, engine: verl, parallelism: { strategy: megatron } }\nagents:\n  - { id: g2, device: cuda, models: [c] }\n`));
    expect(megatron.stderr).to.match(/models\[0\]\.parallelism\.strategy: verl strategies available in this version: fsdp2, fsdp, veomni \(megatron is not\)/);
    // What the shipped multi-GPU preset sets is used: vLLM's expert parallelism, verl's data size and strategy.
    const plan = JSON.parse(cli('start', '--preset', 'presets/distill/multi_teacher.yaml', '--node', 'node-1', '--dry-run', '--json').stdout);
    expect(plan.agents[0].models[0]).to.include({ tensorParallel: 8, expertParallel: true });
  });

  it('parses the environment over the preset once, with the same rules as without a preset', () => {
    const env = { TB_SEQ_WINDOW: '64', TB_MAX_QUEUED_SAMPLES: '7', TB_OP_TIMEOUTS: 'sample=5', TB_FUTURE_RETENTION_S: '600', TB_PORT: '8123' };
    const r = spawnSync(process.execPath, ['--import', 'tsx', 'scripts/tinker-broker.ts', 'start', '--dry-run', '--json'], { encoding: 'utf8', env: { ...process.env, ...env } });
    expect(r.status, r.stderr).to.equal(0);
    const plan = JSON.parse(r.stdout);
    expect(plan.api).to.include({ seqWindow: 64, maxQueuedSamples: 7, retentionS: 600, port: 8123 });
    expect(plan.agents[0].opTimeoutsS).to.deep.equal({ sample: 5 });
    expect(plan.storage.retentionS).to.equal(600);
    const bad = spawnSync(process.execPath, ['--import', 'tsx', 'scripts/tinker-broker.ts', 'start', '--dry-run'], { encoding: 'utf8', env: { ...process.env, TB_PORT: 'eighty', TB_SEQ_WINDOW: '3' } });
    expect(bad.status).to.equal(2);
    expect(bad.stderr).to.match(/TB_PORT: /).and.match(/TB_SEQ_WINDOW: /);
  });

  it("gives a CPU torch engine one thread fewer than the cores unless told otherwise, and its process that OMP_NUM_THREADS", async function () {
    const base = { TB_AGENT_MODELS: 'models/tiny-qwen3', TB_AGENT_ID: 'threads-test' };
    const threads = (env: Record<string, string>) => loadAgentConfig(env).engineThreads;
    expect(threads({ ...base, TB_ENGINE_DEVICE: 'cpu' })).to.equal(Math.max(1, os.availableParallelism() - 1));
    expect(threads({ ...base, TB_ENGINE_DEVICE: 'cpu', TB_ENGINE_THREADS: '3' })).to.equal(3);
    expect(threads({ ...base, TB_ENGINE_DEVICE: 'cpu', OMP_NUM_THREADS: '4' }), "the operator's OMP_NUM_THREADS stays").to.equal(undefined);
    expect(threads({ ...base, TB_ENGINE_DEVICE: 'cuda' })).to.equal(undefined);
    expect(threads(base)).to.equal(undefined);
    expect(() => threads({ ...base, TB_ENGINE_THREADS: '0' })).to.throw(/TB_ENGINE_THREADS/);

    const adapter = Agent.adapterFor(loadAgentConfig({ ...process.env, ...base, TB_ENGINE_DEVICE: 'cpu', TB_ENGINE_THREADS: '1' }), logger);
    await adapter.start();
    try {
      const environ = readFileSync(`/proc/${adapter.enginePids!()[0]}/environ`, 'utf8').split('\0');
      expect(environ).to.include('OMP_NUM_THREADS=1');
    } finally {
      await adapter.stop();
    }
  });

  it('refuses to start a verl agent off the GPUs, before anything starts, in one plain line', () => {
    const r = cli('start', '--preset', write('verlcpu.yaml', `name: t\nmodels:\n  - { name: a, path: /m/a, role: actor, engine: verl }\nagents:\n  - { id: g0, models: [a] }\n`));
    expect(r.status).to.equal(2);
    expect(r.stderr).to.match(/^agent g0: engine 'verl' runs on GPUs; its device is 'cpu'/);
    expect(r.stderr).to.not.match(/^\s+at |Error:/m); // plain lines, no stack trace
    // On its GPUs a verl agent passes the engine check and stops at the next one (its model directory).
    const g = cli('start', '--preset', 'presets/gpu/h200_verl.yaml', '--agent', 'h200-verl');
    expect(g.status).to.equal(2);
    expect(g.stderr.trim()).to.match(/^agent h200-verl: model h200-qwen3-0\.6b-verl has no model directory at \S+\/models\/h200-qwen3-0\.6b /);
  });

  it('prints --dry-run as tables with what start would refuse, and never the API keys', () => {
    // The shipped preset with a secret key of its own.
    const file = write('secret.yaml', readFileSync('presets/distill/multi_teacher.yaml', 'utf8').replace('keys: [tml-local]', 'keys: [tml-secret-4711]'));
    const r = cli('start', '--preset', file, '--dry-run');
    expect(r.status, r.stderr).to.equal(0);
    expect(r.stdout).to.match(/^ {2}n0-actor +node-0 +cuda:0 +1 +- +torch +yes +Qwen\/Qwen3-8B \(actor\)$/m);
    expect(r.stdout).to.match(/^ {2}n0-teacher-32b +node-0 +cuda:4,5,6,7 +4 +- +vllm +yes +Qwen\/Qwen3-32B \(teacher\)$/m);
    expect(r.stdout).to.match(/^ {2}n1-teacher-235b +node-1 +cuda:0,1,2,3,4,5,6,7 +8 +- +vllm +no +Qwen\/Qwen3-235B-A22B \(teacher\)$/m);
    expect(r.stdout).to.match(/! agent n0-actor: model Qwen\/Qwen3-8B has no model directory/);
    expect(r.stdout).to.match(/! agent n0-rollout-a: model Qwen\/Qwen3-8B-rollout has no model directory at \/models\/Qwen3-8B/);
    expect(r.stdout).to.include('(1 API key, not shown)');
    expect(r.stdout).to.not.include('tml-secret-4711');
    const j = cli('start', '--preset', file, '--dry-run', '--json');
    expect(j.stdout).to.not.include('tml-secret-4711');
    expect(JSON.parse(j.stdout).problems).to.have.length(5);
    // The shipped preset keeps the well-known default key on 0.0.0.0: start refuses that too.
    expect(JSON.parse(cli('start', '--preset', 'presets/distill/multi_teacher.yaml', '--dry-run', '--json').stdout).problems[5]).to.match(/refusing to listen on 0\.0\.0\.0/);
    // A verl agent on the CPU is refused.
    const cpu = cli('start', '--preset', write('verlcpu2.yaml', `name: t\nmodels:\n  - { name: a, path: /m/a, role: actor, engine: verl }\nagents:\n  - { id: g0, models: [a] }\n`), '--dry-run');
    expect(cpu.stdout).to.match(/! agent g0: engine 'verl' runs on GPUs; its device is 'cpu'/);
    const ok = cli('start', '--dry-run');
    expect(ok.stdout).to.match(/^ {2}local-0 +local +cpu +- +- +torch +yes +tiny-qwen3 \(actor\)$/m);
    expect(ok.stdout).to.include('start would accept this plan.');
    expect(ok.stdout).to.not.include('tml-local');
  });

  it('answers --help for every command, and operator mistakes with one line and exit code 2', async function () {
    this.timeout(300_000);
    const top = cli('--help');
    expect(top.status).to.equal(0);
    const { COMMANDS } = await import('../scripts/tinker-broker.js');
    for (const name of Object.keys(COMMANDS)) {
      expect(top.stdout).to.match(new RegExp(`^  ${name} `, 'm'));
      const h = cli(name, '--help');
      expect(h.status, name).to.equal(0);
      expect(h.stdout).to.match(new RegExp(`^usage: tinker-broker ${name}`));
      for (const opt of Object.keys(COMMANDS[name]!.options)) expect(h.stdout, `${name} --${opt}`).to.include(`--${opt}`);
    }
    expect(cli('start', '--help').stdout).to.match(/--preset FILE +launch preset .*\(default: presets\/cpu\/tiny\.yaml\)/);
    expect(cli('start', '--help').stdout).to.match(/TB_PORT +api\.port/);
    expect(cli().status).to.equal(2);
    const mistakes: [string[], RegExp][] = [
      [['start', '--bogus'], /^tinker-broker start: unknown option '--bogus'; see 'tinker-broker start --help'$/],
      [['frobnicate'], /^unknown command 'frobnicate'; commands: start, validate, /],
      [['validate'], /^tinker-broker validate: expected FILE\.\.\.; see/],
      [['start', '--agent', 'nope', '--dry-run'], /^preset presets\/cpu\/tiny\.yaml has no agent 'nope'$/],
    ];
    for (const [args, re] of mistakes) {
      const r = cli(...args);
      expect(r.status, args.join(' ')).to.equal(2);
      expect(r.stderr.trim(), args.join(' ')).to.match(re);
      expect(r.stderr.trim().split('\n'), args.join(' ')).to.have.length(1);
    }
  });

  it('refuses a busy port with the fix, before starting anything', async () => {
    const srv = createServer();
    await new Promise<void>((resolve) => srv.listen(0, '127.0.0.1', () => resolve()));
    const port = (srv.address() as { port: number }).port;
    try {
      const r = spawnSync(process.execPath, ['--import', 'tsx', 'scripts/tinker-broker.ts', 'start'], {
        encoding: 'utf8',
        env: { ...process.env, TB_LOG_LEVEL: 'warn', TB_PORT: String(port), REDIS_URL: 'redis://127.0.0.1:1' },
      });
      expect(r.status).to.equal(2);
      expect(r.stderr.trim()).to.equal(`port ${port} is in use; set TB_PORT or api.port in the preset`);
    } finally {
      srv.close();
    }
  });
});
