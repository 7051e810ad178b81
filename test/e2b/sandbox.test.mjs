// The stock e2b SDK against Shoal, addressed the way E2B's self-hosted mode
// does it: E2B_API_URL and E2B_SANDBOX_URL point at Shoal's E2B endpoint,
// and the SDK names the sandbox in the E2b-Sandbox-Id header.
import { test, describe, before, after } from 'node:test'
import assert from 'node:assert/strict'
import http from 'node:http'
import net from 'node:net'
import {
  Sandbox,
  CommandExitError,
  FileNotFoundError,
  NotFoundError,
  SandboxNotFoundError,
  TimeoutError,
} from 'e2b'
import { TEMPLATE, BASE_REF, E2B_URL, SHOAL_API_KEY, resolveShoalDomain, waitFor, shoal } from './helpers.mjs'

resolveShoalDomain()

describe('sandboxes', () => {
  test('create from a Shoal environment, with metadata and envs', async () => {
    const sbx = await Sandbox.create(TEMPLATE, { metadata: { suite: 'e2b', case: 'create' }, envs: { GREETING: 'hello' } })
    try {
      const info = await sbx.getInfo()
      assert.equal(info.sandboxId, sbx.sandboxId)
      assert.equal(info.templateId, TEMPLATE)
      assert.equal(info.state, 'running')
      assert.deepEqual(info.metadata, { suite: 'e2b', case: 'create' })
      assert.ok(info.endAt > info.startedAt)
      const r = await sbx.commands.run('echo $GREETING')
      assert.equal(r.stdout, 'hello\n')
      assert.equal(await sbx.isRunning(), true)
      // The sandbox is an ordinary Shoal sandbox.
      const got = await shoal('shoal.v1.SandboxService/GetSandbox', { id: sbx.sandboxId })
      assert.equal(got.metadata.case, 'create')
    } finally {
      await sbx.kill()
    }
  })

  test('create from a base layer reference', async () => {
    const sbx = await Sandbox.create(BASE_REF)
    try {
      assert.equal((await sbx.commands.run('echo ok')).stdout, 'ok\n')
      assert.equal((await sbx.getInfo()).templateId, BASE_REF)
    } finally {
      await sbx.kill()
    }
  })

  test("the SDK's default template is serve's --e2b-default-template", async () => {
    const sbx = await Sandbox.create() // template "base"
    try {
      assert.equal((await sbx.getInfo()).templateId, 'base')
      assert.equal((await sbx.commands.run('echo default')).stdout, 'default\n')
    } finally {
      await sbx.kill()
    }
  })

  test('an unknown template is refused with a message that says what to fix', async () => {
    await assert.rejects(Sandbox.create('no-such-template'), /neither a Shoal environment.*nor a base layer/)
  })

  test("Shoal's key in E2B's format (e2b_<hex>) is accepted", async () => {
    const hex = SHOAL_API_KEY.replace(/^sk_shoal_/, '')
    const sbx = await Sandbox.create(TEMPLATE, { apiKey: 'e2b_' + hex })
    await sbx.kill()
  })

  test('a wrong API key is refused', async () => {
    await assert.rejects(Sandbox.create(TEMPLATE, { apiKey: 'wrong-key' }), (e) => e.name === 'AuthenticationError')
  })

  test('list with metadata filter and paging', async () => {
    const tag = 'list-' + Date.now()
    const made = []
    try {
      for (let i = 0; i < 3; i++) made.push(await Sandbox.create(TEMPLATE, { metadata: { tag, i: String(i) } }))
      const other = await Sandbox.create(TEMPLATE, { metadata: { tag: 'other' } })
      made.push(other)
      const all = await Sandbox.list({ query: { metadata: { tag } } }).nextItems()
      assert.deepEqual(all.map((s) => s.sandboxId).sort(), made.slice(0, 3).map((s) => s.sandboxId).sort())
      for (const s of all) {
        assert.equal(s.state, 'running')
        assert.equal(s.templateId, TEMPLATE)
        assert.equal(s.metadata.tag, tag)
      }
      // Paging: one at a time, newest first, until the token runs out.
      const pager = Sandbox.list({ query: { metadata: { tag } }, limit: 1 })
      const seen = []
      while (pager.hasNext) {
        const page = await pager.nextItems()
        assert.ok(page.length <= 1)
        seen.push(...page.map((s) => s.sandboxId))
      }
      assert.deepEqual(seen, made.slice(0, 3).map((s) => s.sandboxId).reverse())
      const one = await Sandbox.list({ query: { metadata: { tag, i: '1' } } }).nextItems()
      assert.deepEqual(one.map((s) => s.sandboxId), [made[1].sandboxId])
    } finally {
      for (const s of made) await s.kill()
    }
  })

  test('set timeout', async () => {
    const sbx = await Sandbox.create(TEMPLATE, { timeoutMs: 60_000 })
    try {
      let info = await sbx.getInfo()
      assert.ok(Math.abs(info.endAt - info.startedAt - 60_000) < 5_000, `endAt ${info.endAt} startedAt ${info.startedAt}`)
      await sbx.setTimeout(600_000)
      info = await sbx.getInfo()
      assert.ok(Math.abs(info.endAt - Date.now() - 600_000) < 5_000, `endAt ${info.endAt}`)
    } finally {
      await sbx.kill()
    }
  })

  test('setTimeout(0) ends the sandbox at once, as E2B does; create refuses timeout 0 as E2B does', async () => {
    const sbx = await Sandbox.create(TEMPLATE, { timeoutMs: 600_000 })
    await sbx.setTimeout(0)
    await assert.rejects(Sandbox.getInfo(sbx.sandboxId), SandboxNotFoundError)
    assert.equal(await sbx.isRunning(), false)
    // With onTimeout 'pause', what the timeout does is a pause.
    const ap = await Sandbox.create(TEMPLATE, { timeoutMs: 600_000, lifecycle: { onTimeout: 'pause' } })
    try {
      await ap.setTimeout(0)
      assert.equal((await ap.getInfo()).state, 'paused')
    } finally {
      await ap.kill()
    }
    await assert.rejects(Sandbox.create(TEMPLATE, { timeoutMs: 0 }), /greater than 0/)
  })

  test('a sandbox whose timeout expires is gone, busy or not', async () => {
    // E2B's timeout is a time to live: a running command does not extend it
    // (Shoal's own idle timeout would).
    const sbx = await Sandbox.create(TEMPLATE, { timeoutMs: 3_000 })
    await sbx.commands.run('sleep 1000', { background: true })
    await waitFor(async () => !(await Sandbox.list({ query: { metadata: {} } }).nextItems()).some((s) => s.sandboxId === sbx.sandboxId), {
      timeout: 15_000,
      what: 'the sandbox to expire',
    })
    await assert.rejects(Sandbox.getInfo(sbx.sandboxId), SandboxNotFoundError)
  })

  test('pause without memory (keepMemory: false): the files are kept, the processes are not', async () => {
    const sbx = await Sandbox.create(TEMPLATE)
    try {
      await sbx.files.write('/work/state.txt', 'before pause')
      const bg = await sbx.commands.run('while true; do sleep 1; done', { background: true })
      assert.equal(await sbx.pause({ keepMemory: false }), true)
      assert.equal((await sbx.getInfo()).state, 'paused')
      const again = await Sandbox.connect(sbx.sandboxId, { timeoutMs: 120_000 })
      assert.equal((await again.getInfo()).state, 'running')
      assert.equal(await again.files.read('/work/state.txt'), 'before pause')
      assert.ok(!(await again.commands.list()).some((p) => p.pid === bg.pid), 'a process survived a pause without memory')
      assert.equal((await again.commands.run("ps -o args | grep -c '[s]leep 1' || true")).stdout.trim(), '0')
      assert.equal((await again.commands.run('echo after')).stdout, 'after\n')
    } finally {
      await sbx.kill()
    }
  })

  test('pause, then connect again', async () => {
    const sbx = await Sandbox.create(TEMPLATE)
    try {
      await sbx.files.write('/work/state.txt', 'before pause')
      const bg = await sbx.commands.run('while true; do sleep 1; done', { background: true })
      assert.equal(await sbx.pause(), true)
      assert.equal((await sbx.getInfo()).state, 'paused')
      assert.equal(await sbx.isRunning(), false, 'a paused sandbox is not running')
      assert.equal(await Sandbox.pause(sbx.sandboxId), false, 'pausing a paused sandbox answers false')
      const paused = await Sandbox.list({ query: { state: ['paused'] } }).nextItems()
      assert.ok(paused.some((s) => s.sandboxId === sbx.sandboxId))

      const again = await Sandbox.connect(sbx.sandboxId, { timeoutMs: 120_000 })
      assert.equal((await again.getInfo()).state, 'running')
      assert.equal(await again.isRunning(), true)
      assert.equal(await again.files.read('/work/state.txt'), 'before pause')
      // Its processes were stopped, not killed: they go on.
      assert.ok((await again.commands.list()).some((p) => p.pid === bg.pid))
      assert.equal((await again.commands.run('echo after')).stdout, 'after\n')
      // Connecting to a running sandbox is fine too.
      await Sandbox.connect(sbx.sandboxId)
      // Unlike E2B, a call into a paused sandbox resumes it (as Shoal's
      // own API does) instead of failing.
      assert.equal(await again.pause(), true)
      assert.equal(await again.isRunning(), false)
      assert.equal((await again.commands.run('echo resumed')).stdout, 'resumed\n')
      assert.equal(await again.isRunning(), true)
    } finally {
      await sbx.kill()
    }
  })

  test('autoPause: paused, not killed, at its timeout; connect resumes it', async () => {
    const sbx = await Sandbox.create(TEMPLATE, { timeoutMs: 3000, lifecycle: { onTimeout: 'pause', autoResume: true } })
    try {
      const info = await sbx.getInfo()
      assert.deepEqual(info.lifecycle, { onTimeout: 'pause', autoResume: true })
      await sbx.files.write('/work/state.txt', 'kept')
      const bg = await sbx.commands.run('while true; do sleep 1; done', { background: true })
      await waitFor(async () => (await sbx.getInfo()).state === 'paused', { timeout: 30000, what: 'the auto-pause' })
      assert.equal(await sbx.isRunning(), false)
      const again = await Sandbox.connect(sbx.sandboxId, { timeoutMs: 120_000 })
      assert.equal((await again.getInfo()).state, 'running')
      assert.equal(await again.files.read('/work/state.txt'), 'kept')
      assert.ok((await again.commands.list()).some((p) => p.pid === bg.pid), 'its processes go on')
    } finally {
      await sbx.kill()
    }
  })

  test('kill', async () => {
    const sbx = await Sandbox.create(TEMPLATE)
    assert.equal(await sbx.kill(), true)
    assert.equal(await Sandbox.kill(sbx.sandboxId), false, 'a second kill finds nothing')
    await assert.rejects(sbx.getInfo(), SandboxNotFoundError)
    assert.equal(await sbx.isRunning(), false)
    await assert.rejects(Sandbox.connect(sbx.sandboxId), SandboxNotFoundError)
    await assert.rejects(sbx.commands.run('true'))
  })

  test('a command whose sandbox is killed does not end as an exit', async () => {
    const sbx = await Sandbox.create(TEMPLATE)
    const seen = []
    const h = await sbx.commands.run('echo started; sleep 1000', { background: true, onStdout: (d) => seen.push(d) })
    await waitFor(() => seen.join('').includes('started'), { what: 'the command to start' })
    assert.equal(await sbx.kill(), true)
    // As with E2B: envd dies with the sandbox and the connection drops;
    // the SDK then asks envd's /health (502 for a sandbox that is gone) and
    // reports the sandbox killed or at its end of life, never the
    // command's exit.
    await assert.rejects(h.wait(), (e) => {
      assert.ok(!(e instanceof CommandExitError), `a CommandExitError: ${e}`)
      assert.ok(e instanceof TimeoutError, `not a TimeoutError: ${e}`)
      assert.match(e.message, /The sandbox was killed or reached its end of life while the request was in flight/)
      return true
    })
  })
})

test('a watch whose sandbox is killed is cut as envd cuts it', async () => {
  const sbx = await Sandbox.create(TEMPLATE)
  let resolveExit
  const exited = new Promise((r) => (resolveExit = r))
  await sbx.files.watchDir('/work', () => {}, { onExit: (e) => resolveExit(e) })
  assert.equal(await sbx.kill(), true)
  const e = await exited
  assert.ok(e instanceof TimeoutError, `not a TimeoutError: ${e}`)
  assert.match(e.message, /The sandbox was killed or reached its end of life while the request was in flight/)
})

describe('commands', () => {
  let sbx
  before(async () => {
    sbx = await Sandbox.create(TEMPLATE, { timeoutMs: 600_000 })
  })
  after(async () => {
    await sbx?.kill()
  })

  test('foreground: streamed output and the exit code', async () => {
    const out = []
    const err = []
    const r = await sbx.commands.run('echo one; echo two >&2; echo three', {
      onStdout: (d) => out.push(d),
      onStderr: (d) => err.push(d),
    })
    assert.equal(r.exitCode, 0)
    assert.equal(r.stdout, 'one\nthree\n')
    assert.equal(r.stderr, 'two\n')
    assert.equal(out.join(''), 'one\nthree\n')
    assert.equal(err.join(''), 'two\n')
    // This template has no "user" account: E2B's default user falls back
    // to root, whose home is /root (users.test.mjs has one).
    assert.equal((await sbx.commands.run('pwd')).stdout, '/root\n', 'commands start in the home directory')
    assert.equal((await sbx.commands.run('pwd', { cwd: '/tmp' })).stdout, '/tmp\n')
    assert.equal((await sbx.commands.run('echo $A-$B', { envs: { A: 'x', B: 'y' } })).stdout, 'x-y\n')
    assert.equal((await sbx.commands.run('whoami', { user: 'root' })).stdout, 'root\n')
  })

  test('a non-zero exit is a CommandExitError', async () => {
    await assert.rejects(sbx.commands.run('echo partial; exit 7'), (e) => {
      assert.ok(e instanceof CommandExitError)
      assert.equal(e.exitCode, 7)
      assert.equal(e.stdout, 'partial\n')
      assert.equal(e.error, 'exit status 7')
      return true
    })
  })

  test('background: stream while it runs, then wait', async () => {
    const seen = []
    const h = await sbx.commands.run('for i in 1 2 3; do echo line$i; sleep 0.2; done', {
      background: true,
      onStdout: (d) => seen.push(d),
    })
    assert.ok(h.pid > 0)
    assert.ok((await sbx.commands.list()).some((p) => p.pid === h.pid))
    await waitFor(() => seen.join('').includes('line1'), { what: 'the first line while running' })
    assert.equal(h.exitCode, undefined, 'still running')
    const r = await h.wait()
    assert.equal(r.stdout, 'line1\nline2\nline3\n')
    assert.equal(h.exitCode, 0)
  })

  test('stdin', async () => {
    const h = await sbx.commands.run('cat; echo done', { background: true, stdin: true })
    await h.sendStdin('hello ')
    await sbx.commands.sendStdin(h.pid, 'world\n')
    await h.closeStdin()
    const r = await h.wait()
    assert.equal(r.stdout, 'hello world\ndone\n')
  })

  test('kill a running command', async () => {
    const h = await sbx.commands.run('sleep 1000', { background: true })
    assert.equal(await h.kill(), true)
    await assert.rejects(h.wait(), (e) => {
      assert.ok(e instanceof CommandExitError)
      assert.equal(e.exitCode, -1)
      assert.match(e.error, /signal: killed/)
      return true
    })
    assert.ok(!(await sbx.commands.list()).some((p) => p.pid === h.pid))
    assert.equal(await sbx.commands.kill(h.pid), false, 'an ended command cannot be killed')
  })

  test('re-connect to a running command', async () => {
    const h = await sbx.commands.run('echo start; read x; echo got $x', { background: true, stdin: true })
    await waitFor(() => h.stdout.includes('start'), { what: 'start' })
    await h.disconnect()
    const listed = (await sbx.commands.list()).find((p) => p.pid === h.pid)
    assert.ok(listed, 'listed while running')
    assert.equal(listed.cmd, '/bin/bash')
    assert.deepEqual(listed.args, ['-l', '-c', 'echo start; read x; echo got $x'])

    const again = await sbx.commands.connect(h.pid)
    await again.sendStdin('42\n')
    const r = await again.wait()
    // Shoal keeps a command's output: a re-connect gets it from the start.
    assert.equal(r.stdout, 'start\ngot 42\n')
    assert.equal(r.exitCode, 0)
  })

  test('commands are ordinary Shoal commands', async () => {
    const h = await sbx.commands.run('sleep 30', { background: true })
    try {
      const { commands } = await shoal('shoal.v1.CommandService/ListCommands', { sandboxId: sbx.sandboxId })
      const c = commands.find((c) => Number(c.pid) === h.pid)
      assert.ok(c, 'visible to Shoal: ' + JSON.stringify(commands))
      assert.equal(c.state, 'COMMAND_STATE_RUNNING')
      // And a Shoal command is visible to E2B's process list.
      const started = await shoal('shoal.v1.CommandService/StartCommand', { sandboxId: sbx.sandboxId, args: ['sleep', '30'] })
      const listed = (await sbx.commands.list()).find((p) => p.pid === Number(started.pid))
      assert.ok(listed)
      assert.equal(listed.cmd, 'sleep')
      await sbx.commands.kill(Number(started.pid))
    } finally {
      await h.kill()
    }
  })

  test('the command timeout kills it', async () => {
    const t0 = Date.now()
    await assert.rejects(sbx.commands.run('sleep 30', { timeoutMs: 1000 }))
    assert.ok(Date.now() - t0 < 10_000)
    // The kill and the list race: wait for the command to be gone.
    await waitFor(async () => !(await sbx.commands.list()).some((p) => p.cmd === '/bin/bash' && p.args.at(-1) === 'sleep 30'), {
      what: 'the timed-out command to leave the process list',
    })
  })

  test('pty', async () => {
    let out = ''
    const dec = new TextDecoder()
    const term = await sbx.pty.create({ cols: 80, rows: 24, onData: (d) => (out += dec.decode(d)) })
    await sbx.pty.resize(term.pid, { cols: 100, rows: 30 })
    await sbx.pty.sendInput(term.pid, new TextEncoder().encode('stty size; echo pty-$((6*7))\n'))
    await waitFor(() => out.includes('pty-42'), { what: 'pty output' })
    assert.match(out, /30 100/)
    await sbx.pty.sendInput(term.pid, new TextEncoder().encode('exit\n'))
    const r = await term.wait()
    assert.equal(r.exitCode, 0)
  })
})

describe('files', () => {
  let sbx
  before(async () => {
    sbx = await Sandbox.create(TEMPLATE, { timeoutMs: 600_000 })
  })
  after(async () => {
    await sbx?.kill()
  })

  test('write, read, exists, info', async () => {
    const w = await sbx.files.write('/work/dir/a.txt', 'hello file')
    assert.equal(w.path, '/work/dir/a.txt')
    assert.equal(w.name, 'a.txt')
    assert.equal(await sbx.files.read('/work/dir/a.txt'), 'hello file')
    const bytes = new Uint8Array([0, 1, 2, 255])
    await sbx.files.write('/work/bin.dat', bytes)
    assert.deepEqual(await sbx.files.read('/work/bin.dat', { format: 'bytes' }), bytes)
    assert.equal(await sbx.files.read('/work/dir/a.txt', { gzip: true }), 'hello file')
    await sbx.files.write('/work/gz.txt', 'gzipped upload', { gzip: true })
    assert.equal(await sbx.files.read('/work/gz.txt'), 'gzipped upload')
    await sbx.files.write('/work/empty.txt', '')
    assert.equal(await sbx.files.read('/work/empty.txt'), '')
    assert.equal(await sbx.files.exists('/work/dir/a.txt'), true)
    assert.equal(await sbx.files.exists('/work/nope'), false)
    const info = await sbx.files.getInfo('/work/dir/a.txt')
    assert.equal(info.type, 'file')
    assert.equal(info.size, 10)
    assert.equal(info.name, 'a.txt')
    assert.ok(info.modifiedTime instanceof Date)
    assert.equal((await sbx.files.getInfo('/work/dir')).type, 'dir')
    // Relative paths are under the home directory, as in E2B.
    await sbx.files.write('rel.txt', 'relative')
    assert.equal((await sbx.commands.run('cat /root/rel.txt')).stdout, 'relative')
    // What a command writes, the SDK reads.
    await sbx.commands.run('echo from-shell > /work/shell.txt')
    assert.equal(await sbx.files.read('/work/shell.txt'), 'from-shell\n')
    await assert.rejects(sbx.files.read('/work/missing.txt'), FileNotFoundError)
  })

  test('write several files at once', async () => {
    const res = await sbx.files.write([
      { path: '/work/multi/x.txt', data: 'x' },
      { path: '/work/multi/sub/y.txt', data: 'y' },
    ])
    assert.deepEqual(res.map((e) => e.path).sort(), ['/work/multi/sub/y.txt', '/work/multi/x.txt'])
    assert.equal(await sbx.files.read('/work/multi/sub/y.txt'), 'y')
  })

  test('list, with depth', async () => {
    await sbx.files.write('/work/tree/a/b/c.txt', 'c')
    await sbx.files.write('/work/tree/top.txt', 't')
    const one = await sbx.files.list('/work/tree')
    assert.deepEqual(one.map((e) => [e.name, e.type]).sort(), [['a', 'dir'], ['top.txt', 'file']])
    assert.equal(one.find((e) => e.name === 'top.txt').path, '/work/tree/top.txt')
    const deep = await sbx.files.list('/work/tree', { depth: 3 })
    assert.deepEqual(deep.map((e) => e.path).sort(), ['/work/tree/a', '/work/tree/a/b', '/work/tree/a/b/c.txt', '/work/tree/top.txt'])
    await assert.rejects(sbx.files.list('/work/no-such-dir'), NotFoundError)
  })

  test('make_dir, rename, remove', async () => {
    assert.equal(await sbx.files.makeDir('/work/made/deep'), true)
    assert.equal(await sbx.files.makeDir('/work/made/deep'), false, 'exists already')
    assert.equal((await sbx.files.getInfo('/work/made/deep')).type, 'dir')
    await sbx.files.write('/work/made/f.txt', 'move me')
    const moved = await sbx.files.rename('/work/made/f.txt', '/work/moved/g.txt')
    assert.equal(moved.path, '/work/moved/g.txt')
    assert.equal(await sbx.files.exists('/work/made/f.txt'), false)
    assert.equal(await sbx.files.read('/work/moved/g.txt'), 'move me')
    await sbx.files.rename('/work/moved', '/work/moved2')
    assert.equal(await sbx.files.read('/work/moved2/g.txt'), 'move me')
    await sbx.files.remove('/work/moved2/g.txt')
    assert.equal(await sbx.files.exists('/work/moved2/g.txt'), false)
    await sbx.files.remove('/work/made')
    assert.equal(await sbx.files.exists('/work/made'), false)
    await sbx.files.remove('/work/never-was') // like envd: no error
  })

  test('upload and download URLs', async () => {
    const up = await sbx.uploadUrl('/work/url.txt')
    const form = new FormData()
    form.append('file', new Blob(['by url']), 'url.txt')
    let res = await fetch(up, { method: 'POST', body: form, headers: { 'E2b-Sandbox-Id': sbx.sandboxId } })
    assert.equal(res.status, 200, await res.clone().text())
    res = await fetch(await sbx.downloadUrl('/work/url.txt'), { headers: { 'E2b-Sandbox-Id': sbx.sandboxId } })
    assert.equal(await res.text(), 'by url')
    res = await fetch(`${E2B_URL}/files?path=/work/url.txt&signature=v1_bogus`, { headers: { 'E2b-Sandbox-Id': sbx.sandboxId } })
    assert.equal(res.status, 401)
  })

  test('watch a directory', async () => {
    await sbx.files.makeDir('/work/watched')
    const events = []
    const w = await sbx.files.watchDir('/work/watched', (e) => events.push(e))
    try {
      await sbx.files.write('/work/watched/new.txt', 'x')
      await sbx.commands.run('echo more >> /work/watched/new.txt && mv /work/watched/new.txt /work/watched/renamed.txt && chmod 600 /work/watched/renamed.txt && rm /work/watched/renamed.txt')
      const has = (type, name) => events.some((e) => e.type === type && e.name === name)
      await waitFor(() => has('remove', 'renamed.txt'), { what: 'watch events, got ' + JSON.stringify(events) })
      assert.ok(has('create', 'new.txt'), JSON.stringify(events))
      assert.ok(has('write', 'new.txt'), JSON.stringify(events))
      assert.ok(has('rename', 'new.txt'), JSON.stringify(events))
      assert.ok(has('create', 'renamed.txt'), JSON.stringify(events))
      assert.ok(has('chmod', 'renamed.txt'), JSON.stringify(events))
      assert.ok(!events.some((e) => e.name.includes('shoal-tmp')), 'no temp files: ' + JSON.stringify(events))
      // An upload as envd's watchers see it: created, given to its user, written.
      assert.deepEqual(events.filter((e) => e.name === 'new.txt').slice(0, 3).map((e) => e.type), ['create', 'chmod', 'write'], JSON.stringify(events))
      // Overwriting a file through the SDK is a write, as with envd.
      await sbx.files.write('/work/watched/again.txt', '1')
      events.length = 0
      await sbx.files.write('/work/watched/again.txt', '2')
      await waitFor(() => has('write', 'again.txt'), { what: 'a write event, got ' + JSON.stringify(events) })
    } finally {
      await w.stop()
    }
  })

  test('watch recursively, with entries', async () => {
    await sbx.files.makeDir('/work/rwatch')
    const events = []
    const w = await sbx.files.watchDir('/work/rwatch', (e) => events.push(e), { recursive: true, includeEntry: true })
    try {
      await sbx.files.write('/work/rwatch/sub/deep.txt', 'deep')
      await waitFor(() => events.some((e) => e.name === 'sub/deep.txt' && e.entry?.type === 'file'), {
        what: 'a nested create, got ' + JSON.stringify(events),
      })
    } finally {
      await w.stop()
    }
    await assert.rejects(sbx.files.watchDir('/work/rwatch/sub/deep.txt', () => {}), /not a directory/)
  })
})

describe('ports', () => {
  let sbx
  before(async () => {
    sbx = await Sandbox.create(TEMPLATE, { timeoutMs: 600_000 })
    await sbx.files.write('/work/www/index.html', 'served from the sandbox')
    await sbx.commands.run('httpd -f -p 8000 -h /work/www', { background: true })
  })
  after(async () => {
    await sbx?.kill()
  })

  test('getHost(port) reaches an HTTP server inside the sandbox', async () => {
    const host = sbx.getHost(8000)
    assert.match(host, new RegExp(`^8000-${sbx.sandboxId}\\.shoal\\.localhost:\\d+$`))
    const body = await waitFor(
      async () => {
        const res = await fetch(`http://${host}/index.html`)
        return res.status === 200 && (await res.text())
      },
      { what: `http://${host}/index.html` },
    )
    assert.equal(body, 'served from the sandbox')
  })

  test('the same port through the sandbox-URL headers', async () => {
    const res = await fetch(`${E2B_URL}/index.html`, { headers: { 'E2b-Sandbox-Id': sbx.sandboxId, 'E2b-Sandbox-Port': '8000' } })
    assert.equal(res.status, 200)
    assert.equal(await res.text(), 'served from the sandbox')
  })

  test('a closed port answers 502', async () => {
    const res = await fetch(`http://${sbx.getHost(8001)}/`)
    assert.equal(res.status, 502)
    assert.match(await res.text(), /port 8001 is not open/)
  })

  test('an upgraded connection (WebSocket) passes through', async () => {
    // A server that accepts any upgrade, then echoes.
    await sbx.files.write(
      '/work/up.sh',
      '#!/bin/sh\nwhile read -r l; do l=$(printf %s "$l" | tr -d "\\r"); [ -z "$l" ] && break; done\n' +
        'printf "HTTP/1.1 101 Switching Protocols\\r\\nUpgrade: websocket\\r\\nConnection: Upgrade\\r\\n\\r\\n"\nexec cat\n',
    )
    await sbx.commands.run('chmod +x /work/up.sh && nc -ll -p 9000 -e /work/up.sh', { background: true })
    const port = Number(new URL(E2B_URL).port)
    const got = await waitFor(
      () =>
        new Promise((resolve, reject) => {
          const s = net.connect(port, '127.0.0.1')
          let buf = ''
          s.on('data', (d) => {
            buf += d
            if (buf.startsWith('HTTP/1.1 101') && !buf.includes('echo-me') && buf.includes('\r\n\r\n')) s.write('echo-me\n')
            if (buf.includes('echo-me')) s.end()
          })
          s.on('error', reject)
          s.on('close', () => resolve(buf.includes('echo-me') && buf))
          s.write(`GET /ws HTTP/1.1\r\nHost: ${sbx.getHost(9000)}\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n\r\n`)
          setTimeout(() => s.destroy(), 3000)
        }),
      { what: 'an upgraded connection' },
    )
    assert.match(got, /^HTTP\/1\.1 101 Switching Protocols/)
  })

  test('a long-lived response streams through', async () => {
    // An HTTP server written with nc: answers, then trickles a body.
    await sbx.files.write(
      '/work/slow.sh',
      '#!/bin/sh\nprintf "HTTP/1.0 200 OK\\r\\nContent-Type: text/plain\\r\\n\\r\\n"; for i in 1 2 3; do echo tick$i; sleep 0.3; done\n',
    )
    await sbx.commands.run('chmod +x /work/slow.sh && nc -ll -p 8002 -e /work/slow.sh', { background: true })
    const text = await waitFor(
      () =>
        new Promise((resolve, reject) => {
          http
            .get({ host: '127.0.0.1', port: new URL(E2B_URL).port, path: '/', headers: { 'E2b-Sandbox-Id': sbx.sandboxId, 'E2b-Sandbox-Port': '8002' } }, (res) => {
              let b = ''
              res.on('data', (d) => (b += d))
              res.on('end', () => resolve(res.statusCode === 200 && b))
            })
            .on('error', reject)
        }),
      { what: 'the nc server' },
    )
    assert.equal(text, 'tick1\ntick2\ntick3\n')
  })
})

test('private ports need the traffic access token', async () => {
  const sbx = await Sandbox.create(TEMPLATE, { network: { allowPublicTraffic: false } })
  try {
    assert.ok(sbx.trafficAccessToken)
    await sbx.files.write('/work/www/index.html', 'private')
    await sbx.commands.run('httpd -p 8000 -h /work/www') // daemonizes
    const url = `http://${sbx.getHost(8000)}/`
    assert.equal((await fetch(url)).status, 403)
    const body = await waitFor(async () => {
      const res = await fetch(url, { headers: { 'e2b-traffic-access-token': sbx.trafficAccessToken } })
      return res.status === 200 && (await res.text())
    })
    assert.equal(body, 'private')
  } finally {
    await sbx.kill()
  }
})

test("a sandbox made through Shoal's API has private ports here", async () => {
  const made = await shoal('shoal.v1.SandboxService/CreateSandbox', { base: BASE_REF })
  try {
    await shoal('shoal.v1.CommandService/StartCommand', {
      sandboxId: made.id,
      args: ['sh', '-c', 'mkdir -p /tmp/www && echo shoal-made > /tmp/www/index.html && httpd -p 8000 -h /tmp/www'],
    })
    const sbx = await Sandbox.connect(made.id)
    assert.ok(sbx.trafficAccessToken, 'connect returns the traffic access token of a private sandbox')
    const url = `http://${sbx.getHost(8000)}/`
    const body = await waitFor(async () => {
      const res = await fetch(url, { headers: { 'e2b-traffic-access-token': sbx.trafficAccessToken } })
      return res.status === 200 && (await res.text())
    }, { what: 'httpd with the token' })
    assert.equal(body, 'shoal-made\n')
    // Knowing the ID is not enough, by host name or by header.
    assert.equal((await fetch(url)).status, 403)
    const byHeader = await fetch(`${E2B_URL}/`, { headers: { 'E2b-Sandbox-Id': made.id, 'E2b-Sandbox-Port': '8000' } })
    assert.equal(byHeader.status, 403)
    assert.equal((await fetch(url, { headers: { 'e2b-traffic-access-token': 'x'.repeat(40) } })).status, 403)
    // An E2B call that writes the sandbox's entry (setTimeout) opens nothing.
    await sbx.setTimeout(120_000)
    assert.equal((await fetch(url)).status, 403)
  } finally {
    await shoal('shoal.v1.SandboxService/DeleteSandbox', { id: made.id })
  }
})

test('envd refuses a request without the sandbox access token', async () => {
  const sbx = await Sandbox.create(TEMPLATE)
  try {
    const res = await fetch(`${E2B_URL}/files?path=/etc/passwd`, { headers: { 'E2b-Sandbox-Id': sbx.sandboxId } })
    assert.equal(res.status, 401)
    const ok = await fetch(`${E2B_URL}/health`, { headers: { 'E2b-Sandbox-Id': sbx.sandboxId } })
    assert.equal(ok.status, 204)
    // The API key is not an envd token.
    const res2 = await fetch(`${E2B_URL}/files?path=/etc/passwd`, { headers: { 'E2b-Sandbox-Id': sbx.sandboxId, 'X-Access-Token': SHOAL_API_KEY } })
    assert.equal(res2.status, 401)
  } finally {
    await sbx.kill()
  }
})

test('allowInternetAccess gives the sandbox a link out; none by default', async () => {
  const sbx = await Sandbox.create(TEMPLATE, { allowInternetAccess: true, network: { denyOut: ['198.51.100.0/24'] } })
  try {
    const r = await sbx.commands.run('ip -o -4 addr show eth0')
    assert.match(r.stdout, /inet 10\./)
  } finally {
    await sbx.kill()
  }
  const none = await Sandbox.create(TEMPLATE)
  try {
    const r = await none.commands.run('ip -o link show | grep -v ": lo:" || true')
    assert.equal(r.stdout.trim(), '')
  } finally {
    await none.kill()
  }
})

test('unsupported create options are refused, not ignored', async () => {
  await assert.rejects(Sandbox.create(TEMPLATE, { network: { allowOut: ['example.com'] } }), /host names are not supported/)
})

test('auto-pause without memory (onTimeout keepMemory: false) keeps the files, not the processes', async () => {
  const sbx = await Sandbox.create(TEMPLATE, { timeoutMs: 600_000, lifecycle: { onTimeout: { action: 'pause', keepMemory: false } } })
  try {
    await sbx.files.write('/work/state.txt', 'before timeout')
    await sbx.commands.run('while true; do sleep 1; done', { background: true })
    await sbx.setTimeout(0)
    assert.equal((await sbx.getInfo()).state, 'paused')
    const again = await Sandbox.connect(sbx.sandboxId, { timeoutMs: 120_000 })
    assert.equal(await again.files.read('/work/state.txt'), 'before timeout')
    assert.equal((await again.commands.run("ps -o args | grep -c '[s]leep 1' || true")).stdout.trim(), '0')
  } finally {
    await sbx.kill()
  }
})
