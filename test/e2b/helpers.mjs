// Shared by the tests: settings from the environment the Go wrapper
// (e2b_test.go) sets, and small helpers. The SDK itself reads only its own
// variables (E2B_API_URL, E2B_SANDBOX_URL, E2B_API_KEY, E2B_DOMAIN).
import dns from 'node:dns'

function need(name) {
  const v = process.env[name]
  if (!v) throw new Error(`${name} is not set: run these tests through \`go test ./test/e2b/\`, which starts shoal serve`)
  return v
}

// A Shoal environment (named stack) and a base layer reference, both made by
// the wrapper from a busybox root.
export const TEMPLATE = need('SHOAL_E2B_TEMPLATE')
export const BASE_REF = need('SHOAL_E2B_BASE')
// An environment whose base has E2B's "user" account (/home/user).
export const USER_TEMPLATE = need('SHOAL_E2B_USER_TEMPLATE')
// E2B's kind of template: Debian with bash, python3, sudo and "user", who may
// sudo without a password.
export const DEBIAN_TEMPLATE = need('SHOAL_E2B_DEBIAN_TEMPLATE')
// An environment on the microvm backend; empty where the node has no VMs.
export const VM_TEMPLATE = process.env.SHOAL_E2B_VM_TEMPLATE || ''
// A VM boots a kernel per sandbox: seconds, more under TCG on a busy host.
export const VM_CREATE_TIMEOUT_MS = 300_000
export const SHOAL_URL = need('SHOAL_URL')
export const SHOAL_API_KEY = need('E2B_API_KEY')
export const E2B_URL = need('E2B_API_URL')

// Node does not resolve *.localhost names (browsers and curl do); a
// deployment has wildcard DNS for its E2B domain. This stands in for it.
export function resolveShoalDomain() {
  const orig = dns.lookup
  dns.lookup = function (host, opts, cb) {
    if (typeof opts === 'function') {
      cb = opts
      opts = {}
    }
    if (typeof host === 'string' && (host === 'shoal.localhost' || host.endsWith('.shoal.localhost'))) {
      if (opts && opts.all) return process.nextTick(cb, null, [{ address: '127.0.0.1', family: 4 }])
      return process.nextTick(cb, null, '127.0.0.1', 4)
    }
    return orig.call(dns, host, opts, cb)
  }
}

export const sleep = (ms) => new Promise((r) => setTimeout(r, ms))

// waitFor polls fn until it returns a truthy value.
export async function waitFor(fn, { timeout = 10000, interval = 100, what = 'condition' } = {}) {
  const end = Date.now() + timeout
  let last
  for (;;) {
    try {
      const v = await fn()
      if (v) return v
    } catch (e) {
      last = e
    }
    if (Date.now() > end) throw new Error(`timed out waiting for ${what}${last ? ': ' + last.message : ''}`)
    await sleep(interval)
  }
}

// shoal calls Shoal's own API (Connect JSON over HTTP).
export async function shoal(method, body) {
  const res = await fetch(`${SHOAL_URL}/${method}`, {
    method: 'POST',
    headers: { 'Content-Type': 'application/json', Authorization: `Bearer ${SHOAL_API_KEY}` },
    body: JSON.stringify(body),
  })
  const json = await res.json()
  if (!res.ok) throw new Error(`${method}: ${res.status} ${JSON.stringify(json)}`)
  return json
}
