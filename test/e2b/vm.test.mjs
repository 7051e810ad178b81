// A template whose environment runs on the microvm backend: the same SDK
// calls, a sandbox that is a QEMU microVM with its own kernel.
import os from 'node:os'
import { test, describe, before, after } from 'node:test'
import assert from 'node:assert/strict'
import { Sandbox } from 'e2b'
import { VM_TEMPLATE, VM_CREATE_TIMEOUT_MS, resolveShoalDomain, waitFor } from './helpers.mjs'

resolveShoalDomain()

describe('a microVM template', { skip: VM_TEMPLATE ? false : 'the node offers no microvm backend' }, () => {
  let sbx
  before(async () => {
    sbx = await Sandbox.create(VM_TEMPLATE, { requestTimeoutMs: VM_CREATE_TIMEOUT_MS })
  })
  after(async () => {
    await sbx?.kill()
  })

  test('commands and files in a sandbox with its own kernel', async () => {
    const r = await sbx.commands.run('uname -r; cat /proc/1/cmdline | tr "\\0" " "')
    const [kernel] = r.stdout.split('\n')
    assert.notEqual(kernel, os.release(), 'the sandbox runs the host kernel: not a VM')
    await sbx.files.write('/work/vm.txt', 'from the host\n')
    assert.equal(await sbx.files.read('/work/vm.txt'), 'from the host\n')
    assert.equal((await sbx.commands.run('cat /work/vm.txt; echo $((6*7))')).stdout, 'from the host\n42\n')
    const h = await sbx.commands.run('sleep 30', { background: true })
    await h.kill()
    // The kill is sent; the process leaves the list once it has exited.
    await waitFor(async () => !(await sbx.commands.list()).some((p) => p.pid === h.pid), { what: 'the killed command to leave the list' })
    assert.equal(await sbx.isRunning(), true)
    // Its host name resolves (the agent lists it in /etc/hosts), as in a container.
    const hosts = (await sbx.commands.run('cat /etc/hosts; hostname')).stdout.trim().split('\n')
    assert.ok(hosts.includes(`127.0.1.1\t${hosts.at(-1)}`), hosts.join('\n'))
  })

  test('getHost(port) reaches an HTTP server inside the VM', async () => {
    await sbx.files.write('/work/www/index.html', 'served from the VM')
    await sbx.commands.run('httpd -f -p 8000 -h /work/www', { background: true })
    const host = sbx.getHost(8000)
    const body = await waitFor(
      async () => {
        const res = await fetch(`http://${host}/index.html`)
        return res.status === 200 && (await res.text())
      },
      { what: `http://${host}/index.html` },
    )
    assert.equal(body, 'served from the VM')
    const res = await fetch(`http://${sbx.getHost(8001)}/`)
    assert.equal(res.status, 502)
  })
})
