// Users, as an E2B rollout expects them: a template with a "user" account
// (USER_TEMPLATE), the stock SDK, nothing changed but its settings.
import { test, describe, before, after } from 'node:test'
import assert from 'node:assert/strict'
import { Sandbox } from 'e2b'
import { USER_TEMPLATE, waitFor } from './helpers.mjs'

describe('users', () => {
  let sbx
  before(async () => {
    sbx = await Sandbox.create(USER_TEMPLATE)
  })
  after(async () => {
    await sbx?.kill()
  })

  test('a rollout written for E2B: user, /home/user, relative paths, owners', async () => {
    assert.equal((await sbx.commands.run('pwd')).stdout, '/home/user\n')
    assert.equal((await sbx.commands.run('whoami')).stdout, 'user\n')
    assert.equal((await sbx.commands.run('echo $HOME $USER $LOGNAME; id -G')).stdout, '/home/user user user\n1000 100\n')
    // The agent's solution, written by relative path, run, listed.
    const w = await sbx.files.write('solution.sh', 'echo $((6*7))\n')
    assert.equal(w.path, '/home/user/solution.sh')
    assert.equal((await sbx.commands.run('sh solution.sh')).stdout, '42\n')
    await sbx.files.write('src/lib/util.sh', 'true\n') // parents made, as the user
    assert.equal((await sbx.commands.run('stat -c %U:%G:%a solution.sh src src/lib')).stdout, 'user:user:644\nuser:user:755\nuser:user:755\n')
    await sbx.commands.run("ln -s solution.sh link; mkdir -p d; TZ=UTC touch -d '2001-02-03 04:05:06' d")
    const ents = await sbx.files.list('.')
    const byName = Object.fromEntries(ents.map((e) => [e.name, e]))
    const sol = byName['solution.sh']
    assert.equal(sol.path, '/home/user/solution.sh')
    assert.equal(sol.owner, 'user')
    assert.equal(sol.group, 'user')
    assert.equal(sol.permissions, '-rw-r--r--')
    assert.equal(sol.mode, 0o644)
    assert.equal(sol.size, 14)
    assert.equal(sol.type, 'file')
    assert.ok(Math.abs(sol.modifiedTime.getTime() - Date.now()) < 10 * 60 * 1000, `mtime ${sol.modifiedTime}`)
    assert.equal(byName.link.type, 'symlink')
    assert.equal(byName.link.symlinkTarget, '/home/user/solution.sh')
    assert.equal(byName.d.type, 'dir')
    assert.equal(byName.d.permissions, 'drwxr-xr-x')
    assert.equal(byName.d.modifiedTime.toISOString(), '2001-02-03T04:05:06.000Z')
    const home = await sbx.files.getInfo('/home/user')
    assert.equal(home.owner, 'user')
    const etc = await sbx.files.getInfo('/etc/passwd')
    assert.equal(`${etc.owner}:${etc.group}`, 'root:root')
    // A command's background process and a terminal run as the user too.
    const h = await sbx.commands.run('sleep 0.2; whoami', { background: true })
    assert.equal((await h.wait()).stdout, 'user\n')
    let out = ''
    const dec = new TextDecoder()
    const term = await sbx.pty.create({ cols: 80, rows: 24, onData: (d) => (out += dec.decode(d)) })
    await sbx.pty.sendInput(term.pid, new TextEncoder().encode('echo "pty-$(whoami)-$(pwd)"; exit\n'))
    await waitFor(() => out.includes('pty-user-/home/user'), { what: 'pty output' })
    await term.wait().catch(() => {})
  })

  test('the user option: root, another user, a user that does not exist', async () => {
    assert.equal((await sbx.commands.run('whoami; pwd', { user: 'root' })).stdout, 'root\n/root\n')
    // The user's permissions hold: /etc is root's.
    await assert.rejects(sbx.files.write('/etc/evil', 'x'))
    await assert.rejects(sbx.commands.run('touch /etc/evil'))
    const r = await sbx.files.write('/etc/ok', 'x', { user: 'root' })
    assert.equal(r.path, '/etc/ok')
    assert.equal((await sbx.files.getInfo('/etc/ok')).owner, 'root')
    await sbx.commands.run('echo secret > /root/secret; chmod 600 /root/secret', { user: 'root' })
    await assert.rejects(sbx.files.read('/root/secret'))
    assert.equal(await sbx.files.read('/root/secret', { user: 'root' }), 'secret\n')
    // Relative paths are under the named user's home.
    await sbx.files.write('rootrel.txt', 'r', { user: 'root' })
    assert.equal((await sbx.files.getInfo('/root/rootrel.txt')).owner, 'root')
    await assert.rejects(sbx.commands.run('true', { user: 'nosuchuser' }), /nosuchuser/)
    await assert.rejects(sbx.files.read('x', { user: 'nosuchuser' }), /nosuchuser/)
    // Watches too: root's private directory is not the user's to watch.
    await sbx.commands.run('mkdir -p -m 700 /root/private', { user: 'root' })
    await assert.rejects(sbx.files.watchDir('/root/private', () => {}), /permission|denied/i)
    const w = await sbx.files.watchDir('/root/private', () => {}, { user: 'root' })
    await w.stop()
  })

  test('file metadata (kept as user.e2b.* xattrs, as envd does)', async () => {
    const w = await sbx.files.write('meta.txt', 'm', { metadata: { author: 'model-7', step: '3' } })
    assert.deepEqual(w.metadata, { author: 'model-7', step: '3' })
    assert.deepEqual((await sbx.files.getInfo('meta.txt')).metadata, { author: 'model-7', step: '3' })
    const e = (await sbx.files.list('.')).find((x) => x.name === 'meta.txt')
    assert.deepEqual(e.metadata, { author: 'model-7', step: '3' })
    assert.equal((await sbx.files.getInfo('solution.sh')).metadata, undefined)
  })

  test('gzip uploads and downloads; a gzip bomb is refused', async () => {
    await sbx.files.write('gz.txt', 'gzipped\n'.repeat(1000), { gzip: true })
    assert.equal(await sbx.files.read('gz.txt', { gzip: true }), 'gzipped\n'.repeat(1000))
    assert.equal((await sbx.files.getInfo('gz.txt')).owner, 'user')
    // 72 MiB of zeros compress ~1000:1: past 64 MiB, refused; nothing is left.
    await assert.rejects(sbx.files.write('bomb.bin', new Uint8Array(72 << 20), { gzip: true }), /gzip/)
    assert.equal(await sbx.files.exists('bomb.bin'), false)
  })
})
