// Parts of envd's protocol the JS SDK does not call but other E2B clients
// do (the Python SDK's polling watcher, process tags, the input stream),
// spoken as raw Connect JSON to a sandbox made with the SDK.
import { test, before, after } from 'node:test'
import assert from 'node:assert/strict'
import { Sandbox } from 'e2b'
import { TEMPLATE, E2B_URL, waitFor } from './helpers.mjs'

let sbx
before(async () => {
  sbx = await Sandbox.create(TEMPLATE, { timeoutMs: 300_000 })
})
after(async () => {
  await sbx?.kill()
})

function headers(contentType) {
  return { 'Content-Type': contentType, 'E2b-Sandbox-Id': sbx.sandboxId, 'X-Access-Token': sbx.envdAccessToken }
}

// unary calls a unary RPC with Connect's JSON encoding.
async function unary(method, body) {
  const res = await fetch(`${E2B_URL}/${method}`, { method: 'POST', headers: headers('application/json'), body: JSON.stringify(body) })
  const json = await res.json()
  if (!res.ok) throw Object.assign(new Error(`${method}: ${res.status} ${JSON.stringify(json)}`), { status: res.status, body: json })
  return json
}

function envelope(msg, flags = 0) {
  const payload = new TextEncoder().encode(JSON.stringify(msg))
  const out = new Uint8Array(5 + payload.length)
  out[0] = flags
  new DataView(out.buffer).setUint32(1, payload.length)
  out.set(payload, 5)
  return out
}

// streamCall calls a streaming RPC (Connect JSON envelopes) and returns an
// async iterator of its messages plus an abort function.
async function streamCall(method, messages, extraHeaders = {}) {
  const ac = new AbortController()
  const parts = messages.map((m) => envelope(m))
  const body = new Uint8Array(parts.reduce((n, p) => n + p.length, 0))
  let off = 0
  for (const p of parts) {
    body.set(p, off)
    off += p.length
  }
  const res = await fetch(`${E2B_URL}/${method}`, {
    method: 'POST',
    headers: { ...headers('application/connect+json'), ...extraHeaders },
    body,
    signal: ac.signal,
  })
  assert.equal(res.status, 200)
  const reader = res.body.getReader()
  let buf = new Uint8Array(0)
  async function* messagesOut() {
    for (;;) {
      while (buf.length >= 5) {
        const n = new DataView(buf.buffer, buf.byteOffset).getUint32(1)
        if (buf.length < 5 + n) break
        const flags = buf[0]
        const msg = JSON.parse(new TextDecoder().decode(buf.subarray(5, 5 + n)))
        buf = buf.subarray(5 + n)
        if (flags & 2) {
          if (msg.error) throw new Error(JSON.stringify(msg.error))
          return
        }
        yield msg
      }
      const { done, value } = await reader.read()
      if (done) return
      const next = new Uint8Array(buf.length + value.length)
      next.set(buf)
      next.set(value, buf.length)
      buf = next
    }
  }
  return { messages: messagesOut(), abort: () => ac.abort() }
}

test('the polling watcher (CreateWatcher, GetWatcherEvents, RemoveWatcher)', async () => {
  await sbx.files.makeDir('/work/polled')
  const { watcherId } = await unary('filesystem.Filesystem/CreateWatcher', { path: '/work/polled', recursive: true })
  assert.ok(watcherId)
  await sbx.files.write('/work/polled/sub/a.txt', 'a')
  const events = []
  await waitFor(
    async () => {
      const r = await unary('filesystem.Filesystem/GetWatcherEvents', { watcherId })
      events.push(...(r.events ?? []))
      return events.some((e) => e.name === 'sub/a.txt' && e.type === 'EVENT_TYPE_CREATE')
    },
    { what: 'polled events' },
  )
  await unary('filesystem.Filesystem/RemoveWatcher', { watcherId })
  await assert.rejects(unary('filesystem.Filesystem/GetWatcherEvents', { watcherId }), (e) => e.status === 404)
})

// The synchronous Python SDK's watcher polls once right after a write
// returns (watch_dir, files.write, get_new_events): the write's events must
// be there, as they are in envd, whose watcher shares its process with the
// write. Many iterations with the sandbox's CPUs busy, so that the agent's
// watch lags behind when nothing makes the poll wait for it.
test('a poll right after a write sees its events (create, chmod, write), under load', async () => {
  const hogs = []
  for (let i = 0; i < 3; i++) hogs.push(await sbx.commands.run('while :; do :; done', { background: true }))
  try {
    await sbx.files.makeDir('/work/pollsync')
    const { watcherId } = await unary('filesystem.Filesystem/CreateWatcher', { path: '/work/pollsync' })
    for (let i = 0; i < 40; i++) {
      await sbx.files.write(`/work/pollsync/f${i}.txt`, `content ${i}`)
      const r = await unary('filesystem.Filesystem/GetWatcherEvents', { watcherId })
      const got = (r.events ?? []).map((e) => `${e.type} ${e.name}`)
      const want = ['CREATE', 'CHMOD', 'WRITE'].map((t) => `EVENT_TYPE_${t} f${i}.txt`)
      assert.deepEqual(got, want, `iteration ${i}`)
    }
    await unary('filesystem.Filesystem/RemoveWatcher', { watcherId })
  } finally {
    for (const h of hogs) await h.kill()
  }
})

test('process tags: start with a tag, find, signal and connect by it', async () => {
  const call = await streamCall('process.Process/Start', [
    { process: { cmd: '/bin/sh', args: ['-c', 'echo tagged; sleep 60'] }, tag: 'my-tag', stdin: false },
  ])
  const first = await call.messages.next()
  const pid = first.value.event.start.pid
  assert.ok(pid > 0)
  // Its output first: the agent answers ahead of its commands, so a
  // signal sent at once could land before the shell ran its echo.
  for (let m = await call.messages.next(); !m.done; m = await call.messages.next()) {
    if (m.value.event.data?.stdout) break
  }
  call.abort() // the process goes on
  const { processes } = await unary('process.Process/List', {})
  const p = processes.find((p) => p.tag === 'my-tag')
  assert.ok(p, JSON.stringify(processes))
  assert.equal(p.pid, pid)
  assert.deepEqual(p.config.args, ['-c', 'echo tagged; sleep 60'])

  const conn = await streamCall('process.Process/Connect', [{ process: { tag: 'my-tag' } }])
  assert.equal((await conn.messages.next()).value.event.start.pid, pid)
  await unary('process.Process/SendSignal', { process: { tag: 'my-tag' }, signal: 'SIGNAL_SIGTERM' })
  let out = ''
  let end
  for await (const m of conn.messages) {
    if (m.event.data?.stdout) out += Buffer.from(m.event.data.stdout, 'base64').toString()
    if (m.event.end) end = m.event.end
  }
  assert.equal(out, 'tagged\n')
  assert.equal(end.status, 'signal: terminated')
  await assert.rejects(unary('process.Process/SendSignal', { process: { tag: 'my-tag' }, signal: 'SIGNAL_SIGKILL' }), (e) => e.status === 404)
})

test('keep-alives on a silent process stream', async () => {
  const call = await streamCall('process.Process/Start', [{ process: { cmd: 'sleep', args: ['2.5'] } }], { 'Keepalive-Ping-Interval': '1' })
  const kinds = []
  for await (const m of call.messages) kinds.push(Object.keys(m.event)[0])
  assert.equal(kinds[0], 'start')
  assert.equal(kinds.at(-1), 'end')
  assert.ok(kinds.filter((k) => k === 'keepalive').length >= 2, kinds.join(' '))
})

test('the input stream (StreamInput)', async () => {
  const h = await sbx.commands.run('head -c 11', { background: true, stdin: true })
  const input = (s) => ({ data: { input: { stdin: Buffer.from(s).toString('base64') } } })
  const call = await streamCall('process.Process/StreamInput', [{ start: { process: { pid: h.pid } } }, input('hello '), { keepalive: {} }, input('world')])
  for await (const _ of call.messages);
  const r = await h.wait()
  assert.equal(r.stdout, 'hello world')
})

test('envd errors use Connect codes', async () => {
  await assert.rejects(unary('filesystem.Filesystem/Stat', { path: '/no/such' }), (e) => e.status === 404 && e.body.code === 'not_found')
  await assert.rejects(unary('process.Process/SendInput', { process: { pid: 999999 }, input: { stdin: '' } }), (e) => e.body.code === 'not_found')
  await assert.rejects(unary('filesystem.Filesystem/ListDir', { path: '/etc/passwd' }), (e) => e.body.code === 'invalid_argument')
})
