import { mkdtempSync, rmSync } from 'node:fs';
import os from 'node:os';
import path from 'node:path';
import { expect } from 'chai';
import { TINY_MODEL_ALIAS, TINY_MODEL_DIR } from '../../scripts/stack.js';
import { E2EServer } from './server.js';

/** tinker_cookbook.weights.download fetches checkpoints from the server; PEFT loads what it wrote. */
describe('checkpoint download with the cookbook', function () {
  this.timeout(600_000);
  const server = new E2EServer();
  const out = mkdtempSync(path.join(os.tmpdir(), 'tb-download-'));
  before(async () => server.start());
  after(async () => {
    await server.destroy();
    rmSync(out, { recursive: true, force: true });
  });

  it('downloads a training checkpoint (age-encrypted export) and external weights that score as the server does', () => {
    const r = server.runPython(['test/e2e/sdk_download.py', TINY_MODEL_ALIAS, TINY_MODEL_DIR, out]);
    for (const key of ['training', 'external']) {
      expect(r[`${key}_files`], key).to.include.members(['adapter_config.json', 'adapter_model.safetensors']);
      (r[key] as number[]).forEach((v, i) => expect(v, `${key}[${i}]`).to.be.closeTo(r.served[i], 1e-5));
    }
  });
});
