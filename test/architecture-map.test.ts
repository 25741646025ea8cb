import { spawnSync } from 'node:child_process';
import { existsSync, readFileSync } from 'node:fs';
import path from 'node:path';
import { expect } from 'chai';

/**
 * docs/architecture.md stays a map a newcomer can trust: every production source file is named in it
 * (a file added without its line fails here), every repository path it names in backticks exists, and
 * every relative link resolves. Lua scripts are listed as a group, by name without `.lua`.
 */

const ROOT = path.resolve(import.meta.dirname, '..');
const DOC = path.join(ROOT, 'docs/architecture.md');
const PATH_PREFIXES = ['api/', 'queues/', 'workers/', 'presets/', 'scripts/', 'test/', 'bench/', 'docs/', '.ci/'];
const LUA_DIR = 'queues/runtime/lua/';

function backticked(text: string): string[] {
  return [...text.matchAll(/`([^`\n]+)`/g)].map((m) => m[1]!);
}

function sourceFiles(): string[] {
  const listed = spawnSync('git', ['ls-files', '-co', '--exclude-standard', 'api', 'queues', 'workers', 'scripts', 'presets'], { cwd: ROOT, encoding: 'utf8' });
  expect(listed.status, listed.stderr).to.equal(0);
  return listed.stdout.split('\n').filter((f) => f && existsSync(path.join(ROOT, f)));
}

describe('docs/architecture.md', () => {
  const doc = readFileSync(DOC, 'utf8');
  const named = new Set(backticked(doc));

  it('names every production source file in its map', () => {
    const production = sourceFiles().filter((f) => !f.endsWith('.md') && !f.includes('/tests/') && !f.startsWith(LUA_DIR));
    expect(production.length).to.be.greaterThan(100);
    expect(production.filter((f) => !named.has(f))).to.deep.equal([]);
  });

  it('names every Lua script in the map of queues/runtime/lua/', () => {
    const scripts = sourceFiles()
      .filter((f) => f.startsWith(LUA_DIR) && f.endsWith('.lua'))
      .map((f) => path.basename(f, '.lua'));
    expect(scripts.length).to.be.greaterThan(10);
    expect(scripts.filter((s) => !named.has(s))).to.deep.equal([]);
  });

  it('names only repository paths that exist', () => {
    const paths = [...named].filter((t) => PATH_PREFIXES.some((p) => t.startsWith(p)) && /^[\w./-]+$/.test(t));
    expect(paths.length).to.be.greaterThan(100);
    expect(paths.filter((p) => !existsSync(path.join(ROOT, p)))).to.deep.equal([]);
  });

  it('links only to files that exist', () => {
    const links = [...doc.matchAll(/\]\(([^)#\s]+)(?:#[^)]*)?\)/g)].map((m) => m[1]!).filter((l) => !/^[a-z]+:/.test(l));
    expect(links.length).to.be.greaterThan(3);
    expect(links.filter((l) => !existsSync(path.resolve(path.dirname(DOC), l)))).to.deep.equal([]);
  });
});
