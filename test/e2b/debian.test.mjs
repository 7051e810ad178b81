// E2B's kind of template (DEBIAN_TEMPLATE): Debian with bash, python3 and
// sudo, a "user" who may sudo without a password. What rollouts written for
// E2B do in it: run python as the user, install or fix things with sudo.
import { test, describe, before, after } from 'node:test'
import assert from 'node:assert/strict'
import { Sandbox } from 'e2b'
import { DEBIAN_TEMPLATE } from './helpers.mjs'

// CAP_SYS_ADMIN, which nothing in a sandbox may have, sudo or not.
const CAP_SYS_ADMIN = 21n

function capMask(status, field) {
  const line = status.split('\n').find((l) => l.startsWith(field + ':'))
  assert.ok(line, `no ${field} in ${status}`)
  return BigInt('0x' + line.split(':')[1].trim())
}

describe('an E2B-style Debian template', () => {
  let sbx
  before(async () => {
    sbx = await Sandbox.create(DEBIAN_TEMPLATE)
  })
  after(async () => {
    await sbx?.kill()
  })

  test('python3 and bash, as the user, in /home/user', async () => {
    const r = await sbx.commands.run('python3 -c "import os, getpass; print(os.getcwd(), getpass.getuser(), os.geteuid())"')
    assert.equal(r.stdout, '/home/user user 1000\n')
    assert.equal((await sbx.commands.run('echo $BASH_VERSION | cut -d. -f1')).stdout.trim().length > 0, true)
    await sbx.files.write('hello.py', 'print(6 * 7)\n')
    assert.equal((await sbx.commands.run('python3 hello.py')).stdout, '42\n')
  })

  test('sudo: the user becomes root, with docker\'s capabilities and no more', async () => {
    const who = await sbx.commands.run('sudo -n whoami')
    assert.equal(who.stdout, 'root\n')
    assert.equal(who.stderr, '', 'sudo resolves the host name (the agent lists it in /etc/hosts)')
    assert.equal((await sbx.commands.run('sudo -n id -u')).stdout, '0\n')
    // Without sudo the user may not write to /root; with it, it may.
    await assert.rejects(sbx.commands.run('touch /root/x'), (e) => e.exitCode === 1)
    await sbx.commands.run('sudo -n sh -c "echo fixed > /root/x"')
    assert.equal((await sbx.commands.run('sudo -n cat /root/x')).stdout, 'fixed\n')
    const status = (await sbx.commands.run('sudo -n cat /proc/self/status')).stdout
    for (const f of ['CapEff', 'CapPrm', 'CapBnd']) {
      assert.equal((capMask(status, f) >> CAP_SYS_ADMIN) & 1n, 0n, `${f} has CAP_SYS_ADMIN under sudo:\n${status}`)
    }
    assert.notEqual(capMask(status, 'CapEff'), 0n, `sudo gained no capability:\n${status}`)
    assert.match(status, /^Seccomp:\s+2$/m)
    // A command the user runs has no capability at all.
    const mine = (await sbx.commands.run('cat /proc/self/status')).stdout
    assert.equal(capMask(mine, 'CapEff'), 0n, mine)
  })

  test('files written through the API as root belong to root, and sudo reads them', async () => {
    await sbx.files.write('/root/secret', 'only root\n', { user: 'root' })
    await assert.rejects(sbx.commands.run('cat /root/secret'), (e) => e.exitCode === 1)
    assert.equal((await sbx.commands.run('sudo -n cat /root/secret')).stdout, 'only root\n')
  })
})
