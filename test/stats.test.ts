import { spawn, type ChildProcess } from 'node:child_process';
import { expect } from 'chai';
import { engineMemory, processTree, scanTree } from '../workers/stats.js';

/**
 * An engine's process tree, for its memory figures (/metrics, `tinker-broker agents`): read from
 * each process's `children` files, the same tree a scan of every process's parent finds.
 */
describe('engine process tree', () => {
  let sh: ChildProcess;
  before(async () => {
    // A shell with two children, one of which has a child of its own.
    sh = spawn('sh', ['-c', 'sleep 30 & sh -c "sleep 30 & wait" & wait'], { stdio: 'ignore' });
    for (let i = 0; i < 100 && (await scanTree([sh.pid!])).length < 4; i++) await new Promise((r) => setTimeout(r, 20));
  });
  after(async () => {
    for (const p of (await scanTree([sh.pid!])).reverse()) {
      try {
        process.kill(p, 'SIGKILL');
      } catch {
        // gone already
      }
    }
  });

  it('finds every descendant, as a scan of all processes does', async () => {
    const tree = await processTree([sh.pid!]);
    expect(tree).to.have.length(4);
    expect([...tree].sort()).to.deep.equal([...(await scanTree([sh.pid!]))].sort());
    // A root that is gone stays in the list (its memory reads as nothing), as before.
    expect(await processTree([2 ** 22 + 1])).to.deep.equal([2 ** 22 + 1]);
  });

  it("sums the tree's resident memory", async () => {
    const { rss, gpu } = await engineMemory([sh.pid!], false);
    expect(rss).to.be.a('number').and.above(5 * 2 ** 20);
    expect(gpu).to.equal(null);
  });
});
