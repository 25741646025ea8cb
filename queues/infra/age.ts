import { createCipheriv, createHmac, createPublicKey, diffieHellman, generateKeyPairSync, hkdfSync, randomBytes } from 'node:crypto';
import { open, readFile, rm } from 'node:fs/promises';

/**
 * Encryption to age X25519 recipients (the age v1 file format), for external weights exports
 * that ask for `age_encryption_recipients`: the client decrypts with its identity (the
 * cookbook's `weights.download` uses pyrage). Written from the format's public specification.
 */
const BECH32 = 'qpzry9x8gf2tvdw0s3jn54khce6mua7l';
const CHUNK = 64 * 1024;

function polymod(values: number[]): number {
  const gen = [0x3b6a57b2, 0x26508e6d, 0x1ea119fa, 0x3d4233dd, 0x2a1462b3];
  let chk = 1;
  for (const v of values) {
    const top = chk >>> 25;
    chk = ((chk & 0x1ffffff) << 5) ^ v;
    for (let i = 0; i < 5; i++) if ((top >>> i) & 1) chk ^= gen[i]!;
  }
  return chk >>> 0;
}

/** An `age1…` recipient → its 32-byte X25519 public key; throws on a malformed string. */
export function parseRecipient(recipient: string): Buffer {
  const s = recipient.toLowerCase();
  if (s !== recipient && recipient.toUpperCase() !== recipient) throw new Error(`age recipient ${recipient} mixes upper and lower case`);
  const sep = s.lastIndexOf('1');
  if (sep < 1 || s.slice(0, sep) !== 'age') throw new Error(`'${recipient}' is not an age X25519 recipient (age1…)`);
  const data: number[] = [];
  for (const c of s.slice(sep + 1)) {
    const v = BECH32.indexOf(c);
    if (v < 0) throw new Error(`'${recipient}' has an invalid character '${c}'`);
    data.push(v);
  }
  const hrp = s.slice(0, sep);
  const expanded = [...[...hrp].map((c) => c.charCodeAt(0) >> 5), 0, ...[...hrp].map((c) => c.charCodeAt(0) & 31)];
  if (data.length < 7 || polymod([...expanded, ...data]) !== 1) throw new Error(`'${recipient}' has a bad checksum`);
  const words = data.slice(0, -6);
  let acc = 0;
  let bits = 0;
  const out: number[] = [];
  for (const w of words) {
    acc = (acc << 5) | w;
    bits += 5;
    if (bits >= 8) {
      bits -= 8;
      out.push((acc >> bits) & 0xff);
    }
  }
  if (bits >= 5 || ((acc << (8 - bits)) & 0xff) !== 0 || out.length !== 32) throw new Error(`'${recipient}' does not hold a 32-byte key`);
  return Buffer.from(out);
}

const b64 = (b: Buffer) => b.toString('base64').replace(/=+$/, '');
const hkdf = (ikm: Buffer, salt: Buffer, info: string) => Buffer.from(hkdfSync('sha256', ikm, salt, info, 32));

function seal(key: Buffer, nonce: Buffer, plaintext: Buffer): Buffer {
  const c = createCipheriv('chacha20-poly1305', key, nonce, { authTagLength: 16 });
  return Buffer.concat([c.update(plaintext), c.final(), c.getAuthTag()]);
}

function x25519Stanza(fileKey: Buffer, recipientKey: Buffer): string {
  const eph = generateKeyPairSync('x25519');
  const share = Buffer.from(eph.publicKey.export({ format: 'jwk' }).x!, 'base64url');
  const recipient = createPublicKey({ key: { kty: 'OKP', crv: 'X25519', x: recipientKey.toString('base64url') }, format: 'jwk' });
  const shared = diffieHellman({ privateKey: eph.privateKey, publicKey: recipient });
  const wrapKey = hkdf(shared, Buffer.concat([share, recipientKey]), 'age-encryption.org/v1/X25519');
  const body = b64(seal(wrapKey, Buffer.alloc(12), fileKey));
  const lines = body.match(/.{1,64}/g) ?? [''];
  if (body.length % 64 === 0) lines.push('');
  return `-> X25519 ${b64(share)}\n${lines.join('\n')}\n`;
}

/** Encrypts `plaintext` to every recipient (one file key, one stanza each). */
export function encrypt(plaintext: Buffer, recipients: string[]): Buffer {
  if (recipients.length === 0) throw new Error('no age recipients');
  const keys = recipients.map(parseRecipient);
  const fileKey = randomBytes(16);
  const header = `age-encryption.org/v1\n${keys.map((k) => x25519Stanza(fileKey, k)).join('')}---`;
  const mac = createHmac('sha256', hkdf(fileKey, Buffer.alloc(0), 'header')).update(header).digest();
  const nonce = randomBytes(16);
  const payloadKey = hkdf(fileKey, nonce, 'payload');
  const parts: Buffer[] = [Buffer.from(`${header} ${b64(mac)}\n`), nonce];
  const n = Math.max(1, Math.ceil(plaintext.length / CHUNK));
  for (let i = 0; i < n; i++) {
    const chunkNonce = Buffer.alloc(12);
    chunkNonce.writeUIntBE(i, 5, 6); // 11-byte big-endian counter (high bytes stay zero)
    chunkNonce[11] = i === n - 1 ? 1 : 0;
    parts.push(seal(payloadKey, chunkNonce, plaintext.subarray(i * CHUNK, (i + 1) * CHUNK)));
  }
  return Buffer.concat(parts);
}

/** Replaces `path` by `path.age`, encrypted to the recipients. */
export async function encryptFileInPlace(path: string, recipients: string[]): Promise<string> {
  const out = `${path}.age`;
  const fh = await open(out, 'wx');
  try {
    await fh.writeFile(encrypt(await readFile(path), recipients));
    await fh.sync();
  } finally {
    await fh.close();
  }
  await rm(path);
  return out;
}
