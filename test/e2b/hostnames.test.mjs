// The stock e2b SDK against Shoal the way it talks to E2B's cloud: no
// E2B_SANDBOX_URL, so it reaches envd at https://49983-SANDBOXID.DOMAIN and
// ports at PORT-SANDBOXID.DOMAIN, with the domain Shoal returns. TLS is
// served with the certificate Shoal signs with its own CA (trusted here
// through NODE_EXTRA_CA_CERTS, which the Go wrapper sets).
import { test, after } from 'node:test'
import assert from 'node:assert/strict'
import { Sandbox } from 'e2b'
import { TEMPLATE, resolveShoalDomain, waitFor } from './helpers.mjs'

delete process.env.E2B_SANDBOX_URL // read by the SDK for every sandbox it makes
resolveShoalDomain()

const made = []
after(async () => {
  for (const s of made) await s.kill().catch(() => {})
})

test('envd over https by host name', async () => {
  const sbx = await Sandbox.create(TEMPLATE)
  made.push(sbx)
  assert.match(sbx.sandboxDomain, /^shoal\.localhost:\d+$/)
  const r = await sbx.commands.run('echo over-tls; echo $((2+3))')
  assert.equal(r.stdout, 'over-tls\n5\n')
  await sbx.files.write('/work/h.txt', 'host mode')
  assert.equal(await sbx.files.read('/work/h.txt'), 'host mode')
  assert.deepEqual((await sbx.files.list('/work')).map((e) => e.name), ['h.txt'])
  const events = []
  const w = await sbx.files.watchDir('/work', (e) => events.push(e))
  await sbx.files.write('/work/w.txt', 'w')
  await waitFor(() => events.some((e) => e.name === 'w.txt'), { what: 'a watch event over https' })
  await w.stop()
  // A pre-signed URL works on its own: it names the sandbox in its host.
  const url = await sbx.downloadUrl('/work/h.txt')
  assert.match(url, new RegExp(`^https://49983-${sbx.sandboxId}\\.shoal\\.localhost:\\d+/files\\?`))
  const res = await fetch(url)
  assert.equal(await res.text(), 'host mode')
})

test('ports by host name, over http and https', async () => {
  const sbx = await Sandbox.create(TEMPLATE)
  made.push(sbx)
  await sbx.files.write('/work/www/index.html', 'hello by host name')
  await sbx.commands.run('httpd -f -p 3000 -h /work/www', { background: true })
  for (const scheme of ['http', 'https']) {
    const body = await waitFor(
      async () => {
        const res = await fetch(`${scheme}://${sbx.getHost(3000)}/`)
        return res.status === 200 && (await res.text())
      },
      { what: `${scheme}://${sbx.getHost(3000)}/` },
    )
    assert.equal(body, 'hello by host name')
  }
})
