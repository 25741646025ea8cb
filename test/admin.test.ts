import type { Server } from 'node:http';
import { expect } from 'chai';
import express from 'express';
import { adminAuth, adminKeys } from '../api/admin.js';

/** Who may open the /admin dashboard: it shows every tenant's jobs (the page itself is tested in test/e2e/operations.test.ts). */
describe('admin dashboard keys', () => {
  it('are TB_ADMIN_KEYS, else the API key of a single-key install, else none', () => {
    expect(adminKeys({ apiKeys: ['tml-a'] })).to.deep.equal(['tml-a']);
    expect(adminKeys({ apiKeys: ['tml-a', 'tml-b'] })).to.deep.equal([]);
    expect(adminKeys({ apiKeys: ['tml-a', 'tml-b'], adminKeys: ['tml-ops'] })).to.deep.equal(['tml-ops']);
  });

  async function serve(keys: string[]): Promise<{ url: string; close: () => void }> {
    const app = express();
    app.use('/admin', adminAuth(keys), (_req, res) => {
      res.send('board');
    });
    const server = await new Promise<Server>((resolve) => {
      const s = app.listen(0, '127.0.0.1', () => resolve(s));
    });
    return { url: `http://127.0.0.1:${(server.address() as { port: number }).port}/admin`, close: () => server.close() };
  }
  const basic = (user: string, pass: string) => ({ authorization: `Basic ${Buffer.from(`${user}:${pass}`).toString('base64')}` });

  it('take basic auth (any user, the key as password) or X-API-Key, and ask the browser for it otherwise', async () => {
    const s = await serve(['tml-ops']);
    try {
      const none = await fetch(s.url);
      expect(none.status).to.equal(401);
      expect(none.headers.get('www-authenticate')).to.match(/^Basic realm=/);
      expect((await fetch(s.url, { headers: basic('me', 'tml-wrong') })).status).to.equal(401);
      const ok = await fetch(s.url, { headers: basic('anyone', 'tml-ops') });
      expect(ok.status).to.equal(200);
      expect(await ok.text()).to.equal('board');
      expect((await fetch(s.url, { headers: basic('a:b', 'tml-ops') })).status).to.equal(401); // the user name ends at the first ':'
      expect((await fetch(s.url, { headers: { 'x-api-key': 'tml-ops' } })).status).to.equal(200);
    } finally {
      s.close();
    }
  });

  it('stay closed, saying how to open them, when several tenants share the server and no admin key is set', async () => {
    const s = await serve(adminKeys({ apiKeys: ['tml-a', 'tml-b'] }));
    try {
      const r = await fetch(s.url, { headers: basic('x', 'tml-a') });
      expect(r.status).to.equal(403);
      expect(await r.text()).to.include('TB_ADMIN_KEYS');
    } finally {
      s.close();
    }
  });
});
