import { spawnSync } from 'node:child_process';
import { expect } from 'chai';

/** queues/infra/logger.ts as an operator configures it: TB_LOG_FORMAT and TB_LOG_LEVEL, read at process start. */
function logLines(env: Record<string, string>): string[] {
  const code = [
    "import { logger } from './queues/infra/logger.ts';",
    "const log = logger.child({ agentId: 'gpu0' });",
    "log.debug('job done', { queue: 'train-gpu0', jobId: 't-1-2', op: 'forward_backward', modelId: 'm-1', ms: 12 });",
    "log.warn('job failed', { queue: 'train-gpu0', jobId: 't-1-3', op: 'optim_step', modelId: 'm-1', error: 'a \"quoted\" reason' });",
  ].join('\n');
  const r = spawnSync(process.execPath, ['--import', 'tsx', '--input-type=module', '-e', code], {
    env: { ...process.env, NODE_ENV: '', NO_COLOR: '1', ...env },
    encoding: 'utf8',
  });
  expect(r.status, r.stderr).to.equal(0);
  return r.stderr.trim().split('\n').filter(Boolean);
}

describe('logs (winston, queues/infra/logger.ts)', function () {
  this.timeout(30_000);

  it('TB_LOG_FORMAT=json: one JSON object per line with the ids; TB_LOG_LEVEL=debug includes every job', () => {
    const lines = logLines({ TB_LOG_FORMAT: 'json', TB_LOG_LEVEL: 'debug' }).map((l) => JSON.parse(l));
    expect(lines).to.have.length(2);
    expect(lines[0]).to.include({ level: 'debug', message: 'job done', agentId: 'gpu0', queue: 'train-gpu0', jobId: 't-1-2', op: 'forward_backward', modelId: 'm-1', ms: 12 });
    expect(lines[1]).to.include({ level: 'warn', message: 'job failed', error: 'a "quoted" reason' });
    expect(Date.parse(lines[0].timestamp)).to.be.a('number').and.not.NaN;
  });

  it('text at info (the default): a readable line with key=value ids, quoting values with spaces; debug lines left out', () => {
    const lines = logLines({ TB_LOG_FORMAT: 'text', TB_LOG_LEVEL: 'info' });
    expect(lines).to.have.length(1);
    expect(lines[0]).to.match(/^\d\d:\d\d:\d\d\.\d{3} warn  job failed agentId=gpu0 queue=train-gpu0 jobId=t-1-3 op=optim_step modelId=m-1 error="a \\"quoted\\" reason"$/);
  });

  it('a bad TB_LOG_LEVEL or TB_LOG_FORMAT is said once, and the defaults are used', () => {
    const lines = logLines({ TB_LOG_FORMAT: 'yaml', TB_LOG_LEVEL: 'loud' });
    expect(lines[0]).to.include("TB_LOG_LEVEL='loud' is not a level");
    expect(lines[1]).to.include("TB_LOG_FORMAT='yaml' is not json or text; using text");
    expect(lines.slice(2)).to.have.length(1);
  });
});
