// Tenants through the E2B face: a second tenant's key cannot see, connect
// to, time out or kill the first tenant's sandbox; every such call is
// answered as for a sandbox that does not exist.
import { test, describe, before, after } from 'node:test'
import assert from 'node:assert/strict'
import { Sandbox, SandboxNotFoundError } from 'e2b'
import { TEMPLATE, BASE_REF, SHOAL_URL, shoal } from './helpers.mjs'

async function makeKey(name, tenant, scopes = ['sandboxes', 'layers:read']) {
  const res = await shoal('shoal.v1.AdminService/CreateKey', { name, tenant, scopes })
  return res.secret
}

// shoalAs calls a Shoal procedure with key; it returns the answer, or
// throws with the error's code.
async function shoalAs(key, method, body) {
  const res = await fetch(`${SHOAL_URL}/${method}`, {
    method: 'POST',
    headers: { 'Content-Type': 'application/json', Authorization: `Bearer ${key}` },
    body: JSON.stringify(body),
  })
  const json = await res.json()
  if (!res.ok) throw Object.assign(new Error(`${method}: ${res.status} ${JSON.stringify(json)}`), { code: json.code })
  return json
}

describe('tenants', () => {
  const suffix = `${process.pid}`
  let keyA, keyB
  before(async () => {
    keyA = await makeKey(`e2b-a-${suffix}`, `e2b-a-${suffix}`)
    keyB = await makeKey(`e2b-b-${suffix}`, `e2b-b-${suffix}`)
  })
  after(async () => {
    for (const n of [`e2b-a-${suffix}`, `e2b-b-${suffix}`]) await shoal('shoal.v1.AdminService/DeleteKey', { name: n })
  })

  test("another tenant's key cannot list, connect to or kill a sandbox", async () => {
    const sbx = await Sandbox.create(TEMPLATE, { apiKey: keyA })
    try {
      const mine = await Sandbox.list({ apiKey: keyA }).nextItems()
      assert.deepEqual(mine.map((s) => s.sandboxId), [sbx.sandboxId])
      const theirs = await Sandbox.list({ apiKey: keyB }).nextItems()
      assert.ok(!theirs.some((s) => s.sandboxId === sbx.sandboxId), 'tenant B lists A\'s sandbox')
      await assert.rejects(Sandbox.connect(sbx.sandboxId, { apiKey: keyB }), SandboxNotFoundError)
      await assert.rejects(Sandbox.getInfo(sbx.sandboxId, { apiKey: keyB }), SandboxNotFoundError)
      await assert.rejects(Sandbox.setTimeout(sbx.sandboxId, 1000, { apiKey: keyB }), SandboxNotFoundError)
      assert.equal(await Sandbox.kill(sbx.sandboxId, { apiKey: keyB }), false, 'tenant B killed A\'s sandbox')
      // Answered as for a sandbox that does not exist.
      const missing = 'aaaaaaaaaaaaaaaaaaaa'
      await assert.rejects(Sandbox.connect(missing, { apiKey: keyB }), SandboxNotFoundError)
      // A's sandbox is untouched.
      assert.equal(await sbx.isRunning(), true)
      assert.equal((await sbx.commands.run('echo still-mine')).stdout, 'still-mine\n')
      // The admin (E2B_API_KEY) sees every tenant's sandbox.
      assert.ok((await Sandbox.list().nextItems()).some((s) => s.sandboxId === sbx.sandboxId))
    } finally {
      await Sandbox.kill(sbx.sandboxId, { apiKey: keyA })
    }
  })

  test("templates are the tenant's own or shared: another tenant's environment or layer is not found", async () => {
    const w = ['sandboxes', 'layers:read', 'layers:write']
    const kA = await makeKey(`e2b-la-${suffix}`, `e2b-la-${suffix}`, w)
    const kB = await makeKey(`e2b-lb-${suffix}`, `e2b-lb-${suffix}`, w)
    try {
      // B's own base layer (a tag of the shared one) and environment.
      await shoalAs(kB, 'shoal.v1.LayerService/TagLayer', { source: BASE_REF, target: 'bbase:1' })
      await shoalAs(kB, 'shoal.v1.LayerService/CreateEnvironment', { name: 'benv', base: 'bbase:1' })
      for (const t of ['benv', 'bbase:1', `e2b-lb-${suffix}/benv`, `e2b-lb-${suffix}/bbase:1`]) {
        await assert.rejects(Sandbox.create(t, { apiKey: kA }), /not found|404/i, `A creates from B's template ${t}`)
      }
      // A's own environment of the same name is A's: B's stays B's.
      await shoalAs(kA, 'shoal.v1.LayerService/CreateEnvironment', { name: 'benv', base: BASE_REF, replace: true })
      const env = await shoalAs(kB, 'shoal.v1.LayerService/GetEnvironment', { name: 'benv' })
      assert.equal(env.base, 'bbase:1', "A's replace changed B's environment")
      await assert.rejects(shoalAs(kA, 'shoal.v1.LayerService/DeleteLayer', { ref: `e2b-lb-${suffix}/bbase:1` }), (e) => e.code === 'not_found')
      await assert.rejects(shoalAs(kA, 'shoal.v1.LayerService/TagLayer', { source: BASE_REF, target: `e2b-lb-${suffix}/bbase:1` }), (e) => e.code === 'permission_denied')
      // B creates from its own; A from the shared template.
      const sb = await Sandbox.create('benv', { apiKey: kB })
      await Sandbox.kill(sb.sandboxId, { apiKey: kB })
      const sa = await Sandbox.create(TEMPLATE, { apiKey: kA })
      await Sandbox.kill(sa.sandboxId, { apiKey: kA })
      // The shared template is read-only to tenants.
      await assert.rejects(shoalAs(kA, 'shoal.v1.LayerService/DeleteEnvironment', { name: TEMPLATE }), (e) => e.code === 'permission_denied')
    } finally {
      for (const n of [`e2b-lb-${suffix}/benv`, `e2b-la-${suffix}/benv`]) await shoal('shoal.v1.LayerService/DeleteEnvironment', { name: n }).catch(() => {})
      await shoal('shoal.v1.LayerService/DeleteLayer', { ref: `e2b-lb-${suffix}/bbase:1` }).catch(() => {})
      for (const n of [`e2b-la-${suffix}`, `e2b-lb-${suffix}`]) await shoal('shoal.v1.AdminService/DeleteKey', { name: n })
    }
  })
})
