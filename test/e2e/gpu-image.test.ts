import { spawnSync } from 'node:child_process';
import { readFileSync } from 'node:fs';
import path from 'node:path';
import { expect } from 'chai';
import YAML from 'yaml';

/**
 * The GPU image (the Dockerfile with ENGINES=gpu, tinker-broker:gpu, scripts/docker-build-gpu.sh) that
 * docker-compose.yml's GPU agents run: its engine stack is the one pinned in docker/requirements-gpu.txt
 * and docker/requirements-gpu-nodeps.txt, locked by docker/constraints-gpu.txt.
 *
 * The pin files and the compose wiring are checked always. The image itself only with
 * TB_TEST_GPU_IMAGE=1 (building it downloads ~5 GB; docs/docker.md): then a missing image (or Docker) is a
 * failure; without it that suite is skipped, the reason in its tests' titles. No GPU is needed: the
 * imports run on the CPU.
 *   TB_TEST_GPU_IMAGE=1 npx mocha --no-config --node-option import=tsx --timeout 900000 --exit test/e2e/gpu-image.test.ts
 */
const ROOT = path.resolve('.');
const IMAGE = process.env.TB_GPU_IMAGE ?? 'tinker-broker:gpu';

/** `name==version` lines of a requirements file, by normalized name (PEP 503). */
function pins(file: string): Map<string, string> {
  const out = new Map<string, string>();
  for (const raw of readFileSync(path.join(ROOT, file), 'utf8').split('\n')) {
    const m = /^([A-Za-z0-9._-]+)(?:\[[^\]]*\])?==([^\s;#]+)/.exec(raw.trim());
    if (m?.[1] && m[2]) out.set(m[1].toLowerCase().replace(/[._-]+/g, '-'), m[2]);
  }
  return out;
}

const REQUIRED = new Map([...pins('docker/requirements-gpu.txt'), ...pins('docker/requirements-gpu-nodeps.txt')]);
const LOCK = pins('docker/constraints-gpu.txt');

function run(cmd: string, args: string[]): { status: number | null; stdout: string; stderr: string } {
  return spawnSync(cmd, args, { encoding: 'utf8', cwd: ROOT, timeout: 600_000, maxBuffer: 64 << 20 });
}

function composeConfig(files: string[]): any {
  const v2 = run('docker', ['compose', 'version']).status === 0;
  const [cmd, pre] = v2 ? ['docker', ['compose']] : ['docker-compose', []];
  const r = spawnSync(cmd, [...pre, ...files.flatMap((f) => ['-f', f]), 'config'], {
    encoding: 'utf8',
    cwd: ROOT,
    env: { ...process.env, TB_API_KEYS: 'tml-gpu-image-check' },
  });
  if (r.status !== 0) throw new Error(`${cmd} config exited ${r.status}: ${r.stderr}`);
  return YAML.parse(r.stdout);
}

describe('the GPU image', function () {
  this.timeout(900_000);

  it('pins vllm, verl, torch, transformers and peft, each at its locked version, on the CUDA 13 runtime', () => {
    for (const name of ['vllm', 'verl', 'torch', 'transformers', 'peft']) expect(REQUIRED.has(name), name).to.equal(true);
    // verl is installed apart (--no-deps), so the lock (pip's resolution of requirements-gpu.txt) lacks it.
    for (const [name, version] of REQUIRED) if (name !== 'verl') expect(LOCK.get(name), `${name} in docker/constraints-gpu.txt`).to.equal(version);
    // torch's CUDA runtime comes from the nvidia-* wheels: the CUDA 13 ones, and no CUDA 12 runtime beside them.
    expect(LOCK.get('nvidia-cuda-runtime')).to.match(/^13\./);
    expect([...LOCK.keys()].filter((n) => /^nvidia-.*-cu12$/.test(n) && !n.startsWith('nvidia-cutlass-dsl-libs'))).to.deep.equal([]);
  });

  it('runs the GPU agents from it and everything else from tinker-broker:latest, in both compose variants', () => {
    const gpu = composeConfig(['docker-compose.yml']);
    expect(gpu.services['agent-gpu0'].image).to.equal('tinker-broker:gpu');
    expect(gpu.services['agent-gpu0'].build.args.ENGINES).to.equal('gpu');
    expect(gpu.services.api.image).to.equal('tinker-broker:latest');
    expect(gpu.services.api.build.args?.ENGINES).to.equal(undefined);
    const cpu = composeConfig(['docker-compose.yml', 'docker-compose.cpu.yml']);
    expect(cpu.services['agent-cpu0'].image).to.equal('tinker-broker:latest');
    expect(cpu.services['agent-gpu0'].profiles).to.deep.equal(['gpu']);
  });

  describe(`the image ${IMAGE}`, function () {
    before(function () {
      if (process.env.TB_TEST_GPU_IMAGE !== '1') {
        const reason = ` (skipped: TB_TEST_GPU_IMAGE=1 not set; it checks ${IMAGE}, built by scripts/docker-build-gpu.sh)`;
        for (const t of this.test!.parent!.tests) t.title += reason;
        this.skip();
      }
      const r = run('docker', ['image', 'inspect', IMAGE]);
      if (r.status !== 0) throw new Error(`TB_TEST_GPU_IMAGE=1 but no image ${IMAGE}: build it with scripts/docker-build-gpu.sh (Docker: scripts/docker-ensure.sh)\n${r.stderr}`);
    });

    it('imports vllm, verl, torch, transformers and peft at the pinned versions, torch built for the locked CUDA', () => {
      const script = [
        'import importlib, importlib.metadata as md, json',
        'mods = {n: importlib.import_module(n) for n in ("torch", "transformers", "peft", "vllm", "verl")}',
        'import torch',
        'print(json.dumps({"dist": {n: md.version(n) for n in mods}, "module": {n: m.__version__ for n, m in mods.items()}, "cuda": torch.version.cuda}))',
      ].join('\n');
      const r = run('docker', ['run', '--rm', '--entrypoint', '/app/.venv/bin/python', IMAGE, '-c', script]);
      expect(r.status, r.stderr).to.equal(0);
      const got = JSON.parse(r.stdout.trim().split('\n').pop()!) as { dist: Record<string, string>; module: Record<string, string>; cuda: string };
      for (const name of ['torch', 'transformers', 'peft', 'vllm', 'verl']) {
        expect(got.dist[name], `${name} installed`).to.equal(REQUIRED.get(name));
        // torch's module version carries the local CUDA tag (2.11.0+cu130); the others equal the distribution's.
        expect(got.module[name]?.split('+')[0], `${name}.__version__`).to.equal(REQUIRED.get(name));
      }
      const runtime = LOCK.get('nvidia-cuda-runtime')!.split('.').slice(0, 2).join('.');
      expect(got.cuda).to.equal(runtime);
      expect(got.module.torch).to.equal(`${REQUIRED.get('torch')}+cu${runtime.replace('.', '')}`);
    });

    it('gives the agent its engines: TB_PYTHON and TB_VLLM_BIN name the image environment, whose vllm command loads', () => {
      // `vllm --version` parses the engine arguments, which needs a GPU (vLLM: "Failed to infer device
      // type"); without one, check that the command's entry point, in that environment, imports.
      const check = [
        'import importlib.metadata as md, os, sys',
        '[ep] = md.entry_points(group="console_scripts", name="vllm")',
        'ep.load()',
        'print(sys.executable, os.environ["TB_VLLM_BIN"], ep.value, open(os.environ["TB_VLLM_BIN"]).readline().strip())',
      ].join('\n');
      const r = run('docker', ['run', '--rm', IMAGE, 'sh', '-c', '"$TB_PYTHON" -c "$0"', check]);
      expect(r.status, r.stderr).to.equal(0);
      const [python, vllmBin, entry, shebang] = r.stdout.trim().split('\n').pop()!.split(' ');
      expect(python).to.equal('/app/.venv/bin/python');
      expect(vllmBin).to.equal('/app/.venv/bin/vllm');
      expect(entry).to.equal('vllm.entrypoints.cli.main:main');
      // pip writes the venv's python3 into the script: the same environment as TB_PYTHON.
      expect(shebang).to.equal('#!/app/.venv/bin/python3');
    });
  });
});
