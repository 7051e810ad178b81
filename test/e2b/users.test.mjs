// Users, as an E2B rollout expects them: a template with a "user" account
// (USER_TEMPLATE), the stock SDK, nothing changed but its settings.
import { test, describe, before, after } from 'node:test'
import assert from 'node:assert/strict'
import { Sandbox } from 'e2b'
import { USER_TEMPLATE, SHOAL_URL, SHOAL_API_KEY, waitFor } from './helpers.mjs'

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
    // As envd: a symlink has its target's type, and its resolved target.
    assert.equal(byName.link.type, 'file')
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
    // Commands have the user's permissions: /etc is root's.
    await assert.rejects(sbx.commands.run('touch /etc/evil'))
    // Files act as envd does: root's reach, and what is written (with the
    // directories made for it) is given to the request's user.
    const x = await sbx.files.write('/0/x.txt', 'x')
    assert.equal(x.path, '/0/x.txt')
    assert.equal((await sbx.commands.run('stat -c %U:%G:%a /0 /0/x.txt')).stdout, 'user:user:755\nuser:user:644\n')
    assert.equal((await sbx.files.getInfo('/0/x.txt')).owner, 'user')
    const r = await sbx.files.write('/etc/ok', 'x', { user: 'root' })
    assert.equal(r.path, '/etc/ok')
    assert.equal((await sbx.files.getInfo('/etc/ok')).owner, 'root')
    await sbx.files.makeDir('/work/made/here')
    assert.equal((await sbx.commands.run('stat -c %U /work /work/made /work/made/here')).stdout, 'root\nuser\nuser\n')
    await sbx.commands.run('echo secret > /root/secret; chmod 600 /root/secret', { user: 'root' })
    await assert.rejects(sbx.commands.run('cat /root/secret'))
    assert.equal(await sbx.files.read('/root/secret'), 'secret\n')
    assert.equal(await sbx.files.read('/root/secret', { user: 'root' }), 'secret\n')
    // Shoal's own API keeps acting as the user it names.
    const put = await fetch(`${SHOAL_URL}/v1/sandboxes/${sbx.sandboxId}/files?path=/1/y.txt&user=user`, {
      method: 'PUT',
      headers: { Authorization: `Bearer ${SHOAL_API_KEY}` },
      body: 'y',
    })
    assert.equal(put.status, 403, await put.text())
    // Relative paths are under the named user's home.
    await sbx.files.write('rootrel.txt', 'r', { user: 'root' })
    assert.equal((await sbx.files.getInfo('/root/rootrel.txt')).owner, 'root')
    await assert.rejects(sbx.commands.run('true', { user: 'nosuchuser' }), /nosuchuser/)
    await assert.rejects(sbx.files.read('x', { user: 'nosuchuser' }), /nosuchuser/)
    // Watches too, with root's reach as envd's.
    await sbx.commands.run('mkdir -p -m 700 /root/private', { user: 'root' })
    const w = await sbx.files.watchDir('/root/private', () => {})
    await w.stop()
  })

  test("a symlink's entry as envd gives it: its target's type and mode, its resolved target", async () => {
    await sbx.files.write('st/f.txt', 'test')
    await sbx.commands.run('cd st && chmod 640 f.txt && ln -s f.txt flink && mkdir d && ln -s d dlink && ln -s nowhere dangling && ln -s flink chain')
    const f = await sbx.files.getInfo('st/flink')
    assert.equal(f.type, 'file')
    assert.equal(f.name, 'flink')
    assert.equal(f.path, '/home/user/st/flink')
    assert.equal(f.symlinkTarget, '/home/user/st/f.txt')
    assert.equal(f.mode, 0o640)
    assert.equal(f.permissions, 'Lrwxrwxrwx')
    assert.equal((await sbx.files.getInfo('st/chain')).symlinkTarget, '/home/user/st/f.txt')
    const d = await sbx.files.getInfo('st/dlink')
    assert.equal(d.type, 'dir')
    assert.equal(d.symlinkTarget, '/home/user/st/d')
    const g = await sbx.files.getInfo('st/dangling')
    assert.equal(g.type, undefined)
    assert.equal(g.symlinkTarget, '/home/user/st/dangling')
    const byName = Object.fromEntries((await sbx.files.list('st')).map((e) => [e.name, e]))
    assert.equal(byName.flink.type, 'file')
    assert.equal(byName.dlink.type, 'dir')
    assert.equal(byName['f.txt'].symlinkTarget, undefined)
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
