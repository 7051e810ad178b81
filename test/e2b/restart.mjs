// Two halves of one scenario, run by e2b_test.go around a kill -9 and
// restart of `shoal serve`: an E2B client starts a command, Shoal dies,
// comes back, and a new client re-connects to the command by its pid and
// gets all of its output and its exit code.
//
//   node restart.mjs before   prints {"sandboxId", "pid"}
//   node restart.mjs after SANDBOX PID
import assert from 'node:assert/strict'
import { Sandbox } from 'e2b'
import { TEMPLATE } from './helpers.mjs'

const [phase, sandboxId, pid] = process.argv.slice(2)
if (phase === 'before') {
  const sbx = await Sandbox.create(TEMPLATE, { timeoutMs: 300_000 })
  await sbx.files.write('/work/kept.txt', 'kept across the restart')
  const h = await sbx.commands.run('for i in 1 2 3 4 5 6; do echo tick$i; sleep 0.5; done; exit 4', { background: true, timeoutMs: 0 })
  await new Promise((r) => setTimeout(r, 700))
  await h.disconnect()
  console.log(JSON.stringify({ sandboxId: sbx.sandboxId, pid: h.pid }))
} else if (phase === 'after') {
  const sbx = await Sandbox.connect(sandboxId)
  assert.equal(await sbx.files.read('/work/kept.txt'), 'kept across the restart')
  const h = await sbx.commands.connect(Number(pid))
  await assert.rejects(h.wait(), (e) => {
    assert.equal(e.exitCode, 4)
    assert.equal(e.stdout, 'tick1\ntick2\ntick3\ntick4\ntick5\ntick6\n')
    return true
  })
  assert.equal((await sbx.commands.run('echo still here')).stdout, 'still here\n')
  await sbx.kill()
  console.log('ok')
} else {
  throw new Error('usage: node restart.mjs before | after SANDBOX PID')
}
