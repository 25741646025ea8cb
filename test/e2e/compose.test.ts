import { spawn, spawnSync, type ChildProcess } from 'node:child_process';
import { randomUUID } from 'node:crypto';
import { mkdirSync, readFileSync, rmSync, writeFileSync } from 'node:fs';
import path from 'node:path';
import { expect } from 'chai';
import YAML from 'yaml';
import { E2E_KEY, freePort, PYTHON } from './server.js';

/**
 * `docker compose up`, for real: the image built from the unchanged Dockerfile (scripts/docker-build.sh,
 * which builds the public base images from Debian's packages where Docker Hub is unreachable), the CPU
 * variant started in containers, an unchanged SDK training loop against the port published on
 * loopback with `restart api` in its middle, a second agent service added by the README's recipe
 * serving sampling while the first agent is stopped (its model's futures failing with the documented
 * error), and `down -v` leaving nothing behind. Needs root (starts dockerd, installs docker.io and
 * docker-compose when missing: scripts/docker-ensure.sh). Alone: `npx mocha --no-config --import=tsx --timeout 1800000 --exit test/e2e/compose.test.ts`.
 */
const ROOT = path.resolve('.');
const compose = (() => {
  const v2 = spawnSync('docker', ['compose', 'version'], { encoding: 'utf8' });
  return v2.status === 0 ? { cmd: 'docker', pre: ['compose'] } : { cmd: 'docker-compose', pre: [] as string[] };
})();

function sh(cmd: string, args: string[], env: NodeJS.ProcessEnv = {}, timeoutMs = 600_000): string {
  const r = spawnSync(cmd, args, { encoding: 'utf8', env: { ...process.env, ...env }, cwd: ROOT, timeout: timeoutMs, maxBuffer: 64 << 20 });
  if (r.status !== 0) throw new Error(`${cmd} ${args.join(' ')} exited ${r.status ?? r.signal ?? r.error}\n${r.stdout}\n${r.stderr}`);
  return r.stdout;
}

function composeConfig(files: string[], env: NodeJS.ProcessEnv = {}): any {
  return YAML.parse(sh(compose.cmd, [...compose.pre, ...files.flatMap((f) => ['-f', f]), 'config'], env));
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

describe('docker-compose.yml', function () {
  this.timeout(1_800_000);

  it('refuses to run without TB_API_KEYS (no default key), naming it, for every variant', () => {
    for (const files of [['docker-compose.yml'], ['docker-compose.yml', 'docker-compose.cpu.yml']]) {
      const r = spawnSync(compose.cmd, [...compose.pre, ...files.flatMap((f) => ['-f', f]), 'config'], { encoding: 'utf8', cwd: ROOT, env: { ...process.env, TB_API_KEYS: '' } });
      expect(r.status, r.stdout).to.not.equal(0);
      expect(r.stderr).to.include('set TB_API_KEYS to your own comma-separated tml-... keys');
    }
    const cfg = composeConfig(['docker-compose.yml', 'docker-compose.cpu.yml'], { TB_API_KEYS: 'tml-mine-1,tml-mine-2' });
    expect(cfg.services.api.environment.TB_API_KEYS).to.equal('tml-mine-1,tml-mine-2');
  });

  it('passes compose config: Redis with AOF and noeviction, healthchecks, one GPU per agent service', () => {
    const cfg = composeConfig(['docker-compose.yml'], { TB_API_KEYS: 'tml-config-check' });
    expect(cfg.services.redis.command).to.include.members(['--appendonly', 'yes', '--appendfsync', 'everysec', '--maxmemory-policy', 'noeviction']);
    expect(cfg.services.redis.healthcheck).to.be.an('object');
    expect(cfg.services.api.depends_on.redis.condition).to.equal('service_healthy');
    expect(cfg.services.api.healthcheck).to.be.an('object');
    expect(cfg.services.api.ports[0]).to.satisfy((p: any) => (typeof p === 'string' ? p.startsWith('127.0.0.1:') : p.host_ip === '127.0.0.1'));
    expect(cfg.services['agent-gpu0'].deploy.resources.reservations.devices[0].device_ids).to.deep.equal(['0']);
    expect(Object.keys(cfg.volumes)).to.include.members(['redis-data', 'storage']);
  });

  describe('the CPU variant in containers', function () {
    const project = `tbe2e${randomUUID().slice(0, 8)}`;
    const files = ['docker-compose.yml', 'docker-compose.cpu.yml'];
    const extraFile = path.join('var', `${project}.agent-cpu1.yml`);
    const env: NodeJS.ProcessEnv = { COMPOSE_PROJECT_NAME: project, TB_API_KEYS: E2E_KEY, PWD: ROOT, TB_DRAIN_KEEP_S: '5' };
    const procs: ChildProcess[] = [];
    let base = '';
    const dc = (args: string[], timeoutMs?: number, fileList = files) =>
      sh(compose.cmd, [...compose.pre, ...fileList.flatMap((f) => ['-f', f]), ...args], env, timeoutMs);
    const redisCli = (...args: string[]) => dc(['exec', '-T', 'redis', 'redis-cli', ...args]).trim();
    const health = (service: string) => {
      const id = dc(['ps', '-q', service]).trim();
      return id ? sh('docker', ['inspect', '-f', '{{.State.Health.Status}}', id]).trim() : '';
    };
    const logs = (service: string) => dc(['logs', '--no-color', service], undefined, service === 'agent-cpu1' ? [...files, extraFile] : files);

    before(async () => {
      sh('bash', ['scripts/docker-ensure.sh']);
      env.TB_PORT = String(await freePort());
      base = `http://127.0.0.1:${env.TB_PORT}`;
    });
    after(() => {
      for (const p of procs) if (p.exitCode === null) p.kill('SIGKILL');
      spawnSync(compose.cmd, [...compose.pre, ...[...files, extraFile].flatMap((f) => ['-f', f]), 'down', '-v', '--remove-orphans', '-t', '5'], {
        cwd: ROOT,
        env: { ...process.env, ...env },
        stdio: 'ignore',
      });
      rmSync(extraFile, { force: true });
    });

    it('builds the image from the unchanged Dockerfile', () => {
      const out = sh('bash', ['scripts/docker-build.sh'], {}, 1_500_000);
      expect(out).to.match(/tinker-broker:latest built in \d+ s/);
      const info = sh('docker', ['run', '--rm', 'tinker-broker:latest', '/app/.venv/bin/python', '-c', 'import sys, torch; print(sys.version_info[:2], torch.__version__)']);
      expect(info).to.match(/\(3, 11\) 2\.\d+\.\d+/);
    });

    it('comes up healthy with the API published on 127.0.0.1 only', async () => {
      dc(['up', '-d', '--no-build']);
      await until('healthy redis and api', () => health('redis') === 'healthy' && health('api') === 'healthy', 300_000, 2000);
      const published = dc(['port', 'api', '8000']).trim();
      expect(published).to.equal(`127.0.0.1:${env.TB_PORT}`);
      const r = await fetch(`${base}/healthz`);
      expect(r.status).to.equal(200);
      expect(((await r.json()) as { status: string }).status).to.equal('ready');
      // Redis runs as the compose file says.
      expect(redisCli('CONFIG', 'GET', 'appendonly')).to.match(/appendonly\s+yes/);
      expect(redisCli('CONFIG', 'GET', 'maxmemory-policy')).to.match(/noeviction/);
    });

    it('runs an unchanged SDK training loop through `restart api` in its middle, with no failed future', async () => {
      const loop = spawn(PYTHON, ['test/e2e/sdk_train_loop.py', 'tiny-qwen3', 'pipelined', '40'], {
        env: { ...process.env, TINKER_BASE_URL: base, TINKER_API_KEY: E2E_KEY },
        stdio: ['ignore', 'pipe', 'pipe'],
      });
      procs.push(loop);
      let stdout = '';
      let stderr = '';
      loop.stdout!.on('data', (d) => (stdout += d));
      loop.stderr!.on('data', (d) => (stderr += d));
      const exited = new Promise<number | null>((r) => loop.once('exit', (code) => r(code)));
      // Training is under way once the loop's model (the project's only one) has admitted 10 ops.
      await until('the loop training', () => {
        if (loop.exitCode !== null) throw new Error(`loop exited early:\n${stderr}`);
        const keys = redisCli('--scan', '--pattern', 'tb:gate:*:next').split('\n').filter(Boolean);
        return keys.length === 1 && Number(redisCli('GET', keys[0]!)) > 10;
      }, 180_000, 500);
      const t0 = Date.now();
      dc(['restart', 'api']);
      const restartS = (Date.now() - t0) / 1000;
      expect(loop.exitCode, 'the loop ended before the API restart did').to.equal(null);
      const code = await exited;
      expect(code, `${stderr}\n${logs('api')}`).to.equal(0);
      const out = JSON.parse(stdout.trim().split('\n').pop()!);
      expect(out.nll).to.have.length(40);
      expect(out.nll[39]).to.be.below(out.nll[0] * 0.7);
      expect(out.samples).to.have.length(2);
      process.stdout.write(`      api restart took ${restartS.toFixed(1)} s; NLL ${out.nll[0].toFixed(3)} -> ${out.nll[39].toFixed(3)}\n`);
    });

    it("stops an agent for good (its model is adopted by the second agent service the recipe adds, which also serves sampling)", async () => {
      const script = spawn(PYTHON, ['test/e2e/sdk_agent_stop.py', 'tiny-qwen3'], {
        env: { ...process.env, TINKER_BASE_URL: base, TINKER_API_KEY: E2E_KEY },
        stdio: ['pipe', 'pipe', 'pipe'],
      });
      procs.push(script);
      let stdout = '';
      let stderr = '';
      script.stdout!.on('data', (d) => (stdout += d));
      script.stderr!.on('data', (d) => (stderr += d));
      const exited = new Promise<number | null>((r) => script.once('exit', (code) => r(code)));
      const first = await until('the first training step', () => {
        if (script.exitCode !== null) throw new Error(`script exited early:\n${stderr}`);
        return stdout.includes('\n') ? JSON.parse(stdout.split('\n')[0]!) : null;
      }, 300_000, 500);
      expect(first.loss).to.be.above(0);
      // The model was placed on the only agent, cpu0.
      expect(JSON.parse(redisCli('GET', `tb:model:${first.model_id}`)).agent_id).to.equal('cpu0');

      // README's recipe: copy agent-cpu0 as agent-cpu1 and set TB_AGENT_ID: cpu1.
      const cpuFile = YAML.parse(readFileSync('docker-compose.cpu.yml', 'utf8'));
      const cpu1 = structuredClone(cpuFile.services['agent-cpu0']);
      cpu1.environment.TB_AGENT_ID = 'cpu1';
      mkdirSync('var', { recursive: true });
      writeFileSync(extraFile, YAML.stringify({ services: { 'agent-cpu1': cpu1 } }));
      dc(['up', '-d', '--no-build', 'agent-cpu1'], undefined, [...files, extraFile]);
      await until('agent cpu1 alive', () => redisCli('EXISTS', 'tb:agent:cpu1:alive') === '1', 300_000, 1000);
      // Alive comes first (the id claimed); cpu1 takes sample jobs once its engine serves the model and
      // its field is in the queue's share (workers/agent/sample-share.ts), beside cpu0's.
      await until('both agents in the sample queue’s share', () => {
        const keys = redisCli('KEYS', 'tb:sample-share:*').split('\n').filter(Boolean);
        return keys.length === 1 && redisCli('HKEYS', keys[0]!).split('\n').filter(Boolean).sort().join(',') === 'cpu0,cpu1';
      }, 300_000, 1000);

      // Both agents serve the base model's sampling queue: a burst of 32 samples reaches cpu1 beside cpu0.
      // The engine logs one line per op: `op=sample` for one request, `op=sample_batch … requests=N`
      // for N requests the agent gathered into one batch.
      const engineSamples = (service: string) => {
        const log = logs(service);
        const single = (log.match(/op=sample /g) ?? []).length;
        const batched = [...log.matchAll(/op=sample_batch [^\n]*?requests=(\d+)/g)].reduce((n, m) => n + Number(m[1]), 0);
        return single + batched;
      };
      // Both agents take jobs off the base model's sampling queue, each at most its fair share of
      // what is held and waiting (plus 2) while the other is live: a burst of 32 reaches both. (How it
      // splits exactly depends on which agent ends its batch first: test/e2e/sample-scale-out.test.ts
      // bounds it with longer samples.) With cpu0 busy (paused here: alive, its liveness key current,
      // its share field going stale after 2 s), a burst is served by the recipe's agent cpu1.
      const burst = async (n: number) => {
        script.stdin!.write('burst\n');
        const b = await until(`sampling burst ${n}`, () => {
          if (script.exitCode !== null) throw new Error(`script exited early:\n${stderr}`);
          const lines = stdout.trim().split('\n');
          return lines.length >= 1 + n ? JSON.parse(lines[n]!) : null;
        }, 300_000, 500);
        expect(b.burst).to.deep.equal(Array(32).fill(8));
      };
      const cpu0Before = engineSamples('agent-cpu0');
      await burst(1);
      const [byCpu0, byCpu1] = [engineSamples('agent-cpu0') - cpu0Before, engineSamples('agent-cpu1')];
      process.stdout.write(`      burst of 32 samples, both agents idle: ${byCpu0} on cpu0, ${byCpu1} on cpu1\n`);
      expect(byCpu0 + byCpu1).to.equal(32);
      expect(byCpu0, 'cpu0 took part').to.be.greaterThan(0);
      expect(byCpu1, 'cpu1 took part').to.be.greaterThan(0);
      dc(['pause', 'agent-cpu0']);
      try {
        await burst(2);
      } finally {
        dc(['unpause', 'agent-cpu0']);
      }
      expect(redisCli('EXISTS', 'tb:agent:cpu0:alive')).to.equal('1');
      expect(engineSamples('agent-cpu0') - cpu0Before).to.equal(byCpu0);
      expect(engineSamples('agent-cpu1')).to.equal(byCpu1 + 32);
      const servedByCpu1 = byCpu1 + 32;

      // `stop` drains cpu0: its saved models wait for its restart while the drain record lasts
      // (TB_DRAIN_KEEP_S, 3600 s by default; 5 s here). Once it is gone, cpu0 is gone for good: the
      // reaper leaves its model (snapshotted after its optim_step) to be adopted, and cpu1, which
      // trains the same base, adopts it (docs/reliability.md, "Another agent adopts …").
      dc(['stop', 'agent-cpu0'], 180_000, [...files, extraFile]);
      expect(redisCli('EXISTS', 'tb:agent:cpu0:alive')).to.equal('0');
      await until('the drain record of cpu0 to expire', () => redisCli('EXISTS', 'tb:agent:cpu0:drained') === '0', 60_000, 500);
      script.stdin!.write('go\n');
      expect(await exited, stderr).to.equal(0);
      const res = JSON.parse(stdout.trim().split('\n').pop()!);
      // The op sent after cpu0 is gone waits for the adoption and runs on cpu1.
      expect(res.after_stop_error, stdout).to.equal('');
      expect(JSON.parse(redisCli('GET', `tb:model:${first.model_id}`))).to.include({ agent_id: 'cpu1', orphaned_at: null, lost_reason: null });
      expect(res.sample_error).to.equal('');
      expect(res.sample_tokens).to.have.length(8);
      // cpu0 is stopped: the sample ran on cpu1, the recipe's agent.
      expect(engineSamples('agent-cpu1')).to.equal(servedByCpu1 + 1);
    });

    it('`down -v` leaves no container, volume or network of the project', () => {
      dc(['down', '-v', '--remove-orphans'], 300_000, [...files, extraFile]);
      const label = `label=com.docker.compose.project=${project}`;
      expect(sh('docker', ['ps', '-aq', '--filter', label]).trim()).to.equal('');
      expect(sh('docker', ['volume', 'ls', '-q', '--filter', label]).trim()).to.equal('');
      expect(sh('docker', ['network', 'ls', '-q', '--filter', label]).trim()).to.equal('');
    });
  });
});
