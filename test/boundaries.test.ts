import { readdirSync, readFileSync } from 'node:fs';
import path from 'node:path';
import { expect } from 'chai';

/**
 * The layering of DESIGN.md: `api/` and `workers/` are siblings over `queues/`. Neither imports the
 * other, and `queues/` imports neither (nor `presets/` or `scripts/`, which sit above all three).
 * This reads every import and re-export specifier of the TypeScript sources, static and dynamic.
 */
const ROOT = path.resolve(import.meta.dirname, '..');

function sources(dir: string): string[] {
  return readdirSync(path.join(ROOT, dir), { recursive: true, withFileTypes: true })
    .filter((f) => f.isFile() && /\.(ts|mts)$/.test(f.name) && !f.parentPath.includes('node_modules'))
    .map((f) => path.relative(ROOT, path.join(f.parentPath, f.name)));
}

const SPECIFIER = /(?:^|[\s;])(?:import|export)\s[^'"]*?from\s*['"]([^'"]+)['"]|import\(\s*['"]([^'"]+)['"]\s*\)|^\s*import\s*['"]([^'"]+)['"]/gm;

/** The repository path each relative import of `file` lands on. */
function importedPaths(file: string): Array<{ spec: string; target: string }> {
  const text = readFileSync(path.join(ROOT, file), 'utf8');
  const out: Array<{ spec: string; target: string }> = [];
  for (const m of text.matchAll(SPECIFIER)) {
    const spec = m[1] ?? m[2] ?? m[3];
    if (!spec?.startsWith('.')) continue;
    out.push({ spec, target: path.relative(ROOT, path.resolve(path.dirname(path.join(ROOT, file)), spec)) });
  }
  return out;
}

/** The top-level folder each relative import of `file` lands in. */
function importedFolders(file: string): Array<{ spec: string; folder: string }> {
  return importedPaths(file).map(({ spec, target }) => ({ spec, folder: target.split(path.sep)[0] ?? '' }));
}

const FORBIDDEN: Record<string, string[]> = {
  api: ['workers', 'presets', 'scripts', 'test', 'bench'],
  workers: ['api', 'presets', 'scripts', 'test', 'bench'],
  queues: ['api', 'workers', 'presets', 'scripts', 'test', 'bench'],
};

describe('import boundaries', () => {
  for (const [folder, forbidden] of Object.entries(FORBIDDEN)) {
    it(`${folder}/ imports none of ${forbidden.join(', ')}`, () => {
      const files = sources(folder);
      expect(files.length).to.be.greaterThan(0);
      const bad = files.flatMap((f) => importedFolders(f).filter((i) => forbidden.includes(i.folder)).map((i) => `${f} imports ${i.spec}`));
      expect(bad).to.deep.equal([]);
    });
  }

  // Inside queues/: the contract (what API and agents agree on) stands on nothing else of the broker;
  // infrastructure (config, logging, Redis, encryption) on the contract alone; the registry and the
  // runtime (gate, consumer, outcomes, completions, liveness) on both.
  const QUEUES_LAYERS: Record<string, string[]> = {
    'queues/contract': ['queues/contract'],
    'queues/infra': ['queues/contract', 'queues/infra'],
  };
  for (const [folder, allowed] of Object.entries(QUEUES_LAYERS)) {
    it(`${folder}/ imports only ${allowed.join(', ')}`, () => {
      const files = sources(folder);
      expect(files.length).to.be.greaterThan(0);
      const bad = files.flatMap((f) =>
        importedPaths(f)
          .filter((i) => !allowed.some((a) => i.target.startsWith(a + path.sep)))
          .map((i) => `${f} imports ${i.spec}`),
      );
      expect(bad).to.deep.equal([]);
    });
  }

  it("the launcher loads the API's and the agent's modules only on a node that runs them", () => {
    // Static value imports of scripts/tinker-broker.ts: the light key check from api/auth.ts only;
    // api/main.ts and workers/agent.ts are imported when the node serves the API or runs agents.
    const text = readFileSync(path.join(ROOT, 'scripts/tinker-broker.ts'), 'utf8');
    const eager = [...text.matchAll(/^import\s+(?!type\s)[^'"]*?from\s*['"](\.\.\/(?:api|workers)\/[^'"]+)['"]/gm)].map((m) => m[1]);
    expect(eager).to.deep.equal(['../api/auth.js']);
    expect(text).to.include("await import('../workers/agent.js')").and.to.include("await import('../api/main.js')");
  });

  it('detects a forbidden import (the scanner itself works)', () => {
    // api/main.ts imports queues/: the scanner must see it, or the tests above prove nothing.
    expect(importedFolders('api/main.ts').map((i) => i.folder)).to.include('queues');
  });
});
