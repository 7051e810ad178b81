// Tenants through the E2B face: a second tenant's key cannot see, connect
// to, time out or kill the first tenant's sandbox; every such call is
// answered as for a sandbox that does not exist.
import { test, describe, before, after } from 'node:test'
import assert from 'node:assert/strict'
import { Sandbox, SandboxNotFoundError } from 'e2b'
import { TEMPLATE, shoal } from './helpers.mjs'

async function makeKey(name, tenant) {
  const res = await shoal('shoal.v1.AdminService/CreateKey', { name, tenant, scopes: ['sandboxes', 'layers:read'] })
  return res.secret
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
})
