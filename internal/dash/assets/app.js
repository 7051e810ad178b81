// Shoal's dashboard: plain JavaScript, no build step. It logs in with an API
// key (POST /dash/login gives a session token, kept in sessionStorage),
// then calls the ordinary Connect JSON API with that token, polls
// MonitorService/GetStatus every POLL_MS, and opens a terminal over the
// WebSocket of /dash/terminal with a single-use ticket. Everything from
// the server is shown as text (textContent, xterm.js), never as HTML.
"use strict";

const POLL_MS = 2000;
const HISTORY = 150; // chart points (5 minutes at POLL_MS)
const OUTPUT_MAX = 256 << 10; // bytes of a command's output shown

const $ = (sel) => document.querySelector(sel);
let token = sessionStorage.getItem("shoal.token") || "";
let prev = null; // the previous status sample
let series = { creates: [], hostMem: [], sbMem: [] };
let selected = ""; // sandbox shown in the detail panel
let pollTimer = null;
let outputAbort = null;
let term = null, termSocket = null;

// --- API ---

class APIError extends Error {
  constructor(code, message) { super(message); this.code = code; }
}

async function api(method, body) {
  const res = await fetch("/shoal.v1." + method, {
    method: "POST",
    headers: { "Content-Type": "application/json", "Authorization": "Bearer " + token },
    body: JSON.stringify(body || {}),
  });
  if (res.status === 401) { logout(); throw new APIError("unauthenticated", "session expired"); }
  const data = await res.json().catch(() => ({}));
  if (!res.ok) throw new APIError(data.code || String(res.status), data.message || res.statusText);
  return data;
}

// stream calls a server-streaming RPC with the Connect protocol (JSON
// messages in 5-byte envelopes) and hands each message to onMessage.
async function stream(method, body, onMessage, signal) {
  const json = new TextEncoder().encode(JSON.stringify(body));
  const env = new Uint8Array(5 + json.length);
  new DataView(env.buffer).setUint32(1, json.length);
  env.set(json, 5);
  const res = await fetch("/shoal.v1." + method, {
    method: "POST", signal, body: env,
    headers: { "Content-Type": "application/connect+json", "Authorization": "Bearer " + token },
  });
  if (!res.ok) {
    const data = await res.json().catch(() => ({}));
    throw new APIError(data.code || String(res.status), data.message || res.statusText);
  }
  const reader = res.body.getReader();
  let buf = new Uint8Array(0);
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    const next = new Uint8Array(buf.length + value.length);
    next.set(buf); next.set(value, buf.length); buf = next;
    while (buf.length >= 5) {
      const flags = buf[0], n = new DataView(buf.buffer, buf.byteOffset).getUint32(1);
      if (buf.length < 5 + n) break;
      const msg = JSON.parse(new TextDecoder().decode(buf.subarray(5, 5 + n)));
      buf = buf.slice(5 + n);
      if (flags & 2) { // end of stream
        if (msg.error) throw new APIError(msg.error.code, msg.error.message);
        return;
      }
      onMessage(msg);
    }
  }
}

// --- formatting ---

const num = (v) => Number(v || 0);
function bytes(n) {
  n = Number(n);
  if (n < 0) return "?";
  const u = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  while (n >= 1024 && i < u.length - 1) { n /= 1024; i++; }
  return (i === 0 ? n : n.toFixed(n < 10 ? 1 : 0)) + " " + u[i];
}
function dur(s) {
  s = Math.max(0, Math.floor(s));
  if (s < 60) return s + "s";
  if (s < 3600) return Math.floor(s / 60) + "m" + String(s % 60).padStart(2, "0") + "s";
  if (s < 86400) return Math.floor(s / 3600) + "h" + String(Math.floor(s % 3600 / 60)).padStart(2, "0") + "m";
  return Math.floor(s / 86400) + "d" + Math.floor(s % 86400 / 3600) + "h";
}
function el(tag, text, cls) {
  const e = document.createElement(tag);
  if (text !== undefined) e.textContent = text;
  if (cls) e.className = cls;
  return e;
}
function row(cells) {
  const tr = document.createElement("tr");
  for (const c of cells) {
    const td = el("td", c.t !== undefined ? c.t : c, c.cls);
    tr.appendChild(td);
  }
  return tr;
}

// --- login ---

async function login(ev) {
  ev.preventDefault();
  $("#login-error").textContent = "";
  const res = await fetch("/dash/login", {
    method: "POST", headers: { "Content-Type": "application/json" },
    body: JSON.stringify({ key: $("#login-key").value }),
  });
  const data = await res.json().catch(() => ({}));
  if (!res.ok) { $("#login-error").textContent = data.message || "login failed"; return; }
  token = data.token;
  sessionStorage.setItem("shoal.token", token);
  sessionStorage.setItem("shoal.who", (data.name || "admin") + (data.tenant ? " (tenant " + data.tenant + ")" : "") + (data.admin ? " · admin" : ""));
  $("#login-key").value = "";
  show();
}

function logout() {
  if (token) fetch("/dash/logout", { method: "POST", headers: { "Authorization": "Bearer " + token } }).catch(() => {});
  token = "";
  sessionStorage.removeItem("shoal.token");
  closeTerminal();
  show();
}

function show() {
  const in_ = !!token;
  $("#login-view").hidden = in_;
  $("#main-view").hidden = !in_;
  $("#logout").hidden = !in_;
  $("#who").textContent = in_ ? sessionStorage.getItem("shoal.who") || "" : "";
  clearTimeout(pollTimer);
  if (in_) { poll(); layers(); }
}

// --- status, nodes, charts, sandboxes ---

async function poll() {
  try {
    const st = await api("MonitorService/GetStatus");
    render(st);
  } catch (e) {
    console.warn("status", e);
  }
  if (token) pollTimer = setTimeout(poll, POLL_MS);
}

function render(st) {
  const t = Date.parse(st.time) / 1000;
  const nodes = st.nodes || [];
  const sbs = st.sandboxes || [];
  const cpuPct = {};
  if (prev) {
    const dt = t - prev.t;
    for (const s of sbs) {
      const p = prev.sb[s.id];
      if (p !== undefined && dt > 0 && num(s.cpuUsec) >= 0 && p >= 0) cpuPct[s.id] = (num(s.cpuUsec) - p) / 1e6 / dt * 100;
    }
    // Creates/s of the whole fleet: each answering node's count since
    // the last sample (a node that restarted counts from 0 again).
    const up = nodes.filter((n) => (n.state || "up") === "up");
    if (up.length && dt > 0) {
      let created = 0;
      for (const n of up) {
        const p = prev.creates[n.name];
        if (p !== undefined) created += Math.max(0, num(n.createsTotal) - (num(n.createsTotal) >= p ? p : 0));
      }
      const rate = created / dt;
      push(series.creates, rate);
      $("#creates-now").textContent = "now " + rate.toFixed(1);
    }
  }
  let sbMem = 0;
  for (const s of sbs) if (num(s.memoryBytes) > 0) sbMem += num(s.memoryBytes);
  const upNodes = nodes.filter((n) => (n.state || "up") === "up");
  if (upNodes.length) {
    let hostUsed = 0;
    for (const n of upNodes) hostUsed += num(n.memoryTotalBytes) - num(n.memoryAvailableBytes);
    push(series.hostMem, hostUsed);
    push(series.sbMem, sbMem);
    $("#mem-now").textContent = "now " + bytes(hostUsed) + " / " + bytes(sbMem) + (upNodes.length > 1 ? " (" + upNodes.length + " nodes)" : "");
  } else {
    push(series.sbMem, sbMem);
  }
  const nodeCPU = {};
  if (prev) for (const n of nodes) {
    const p = prev.node[n.name];
    if (p !== undefined && t > prev.t) nodeCPU[n.name] = (num(n.cpuUsec) - p) / 1e6 / (t - prev.t) / Math.max(1, n.cpus) * 100;
  }
  renderNodes(nodes, nodeCPU);
  chart($("#chart-creates"), [series.creates], ["#2f7ed8"], (v) => v.toFixed(1));
  chart($("#chart-memory"), [series.hostMem, series.sbMem], ["#2f7ed8", "#e8743b"], bytes);
  renderSandboxes(sbs, cpuPct, t);
  prev = { t, sb: {}, node: {}, creates: {} };
  for (const s of sbs) prev.sb[s.id] = num(s.cpuUsec);
  for (const n of nodes) if ((n.state || "up") === "up") { prev.node[n.name] = num(n.cpuUsec); prev.creates[n.name] = num(n.createsTotal); }
}

function push(a, v) { a.push(v); if (a.length > HISTORY) a.shift(); }

function renderNodes(nodes, cpu) {
  const box = $("#nodes");
  box.replaceChildren();
  const count = {};
  for (const n of nodes) count[n.state || "up"] = (count[n.state || "up"] || 0) + 1;
  $("#node-count").textContent = Object.keys(count).sort().map((k) => count[k] + " " + k).join(", ");
  if (!nodes.length) { box.appendChild(el("p", "Node figures need an admin key.", "muted")); return; }
  const now = Date.now() / 1000;
  for (const n of nodes) {
    const state = n.state || "up";
    const c = el("div", undefined, "card" + (state === "up" ? "" : " node-" + state));
    c.dataset.node = n.name;
    c.appendChild(el("b", n.name));
    c.appendChild(el("span", " " + state, "state-" + state));
    if (n.heartbeatAt || n.url) {
      const hb = n.heartbeatAt ? (state === "down" ? "lease ended " : "heartbeat ") + dur(now - Date.parse(n.heartbeatAt) / 1000) + " ago" : "";
      c.appendChild(el("div", [hb, n.url || ""].filter(Boolean).join(" · "), "muted"));
    }
    if (state !== "up") {
      // Not answering: what its last capacity report said.
      c.appendChild(el("div", "Sandboxes " + num(n.sandboxes) + " at its last report · limits " + bytes(num(n.sandboxMemoryBytes)) +
        (num(n.memoryLimitBytes) ? " of " + bytes(num(n.memoryLimitBytes)) : "") + ", " + (num(n.sandboxMillicpu) / 1000).toFixed(1) +
        (num(n.millicpuLimit) ? " of " + (num(n.millicpuLimit) / 1000).toFixed(1) : "") + " CPUs"));
      box.appendChild(c);
      continue;
    }
    const total = num(n.memoryTotalBytes), used = total - num(n.memoryAvailableBytes);
    const lines = [
      ["CPUs " + n.cpus + " · load " + [n.load1, n.load5, n.load15].map((x) => num(x).toFixed(2)).join(" ") +
        (cpu[n.name] !== undefined ? " · busy " + cpu[n.name].toFixed(0) + "%" : ""), cpu[n.name] || 0],
      ["Memory " + bytes(used) + " of " + bytes(total) + " used", total ? used / total * 100 : 0],
      ["Sandboxes " + num(n.sandboxes) + " · limits " + bytes(num(n.sandboxMemoryBytes)) +
        (num(n.memoryLimitBytes) ? " of " + bytes(num(n.memoryLimitBytes)) : "") + ", " + (num(n.sandboxMillicpu) / 1000).toFixed(1) +
        (num(n.millicpuLimit) ? " of " + (num(n.millicpuLimit) / 1000).toFixed(1) : "") + " CPUs",
        num(n.memoryLimitBytes) ? num(n.sandboxMemoryBytes) / num(n.memoryLimitBytes) * 100 : -1],
      ["Creates since start " + num(n.createsTotal), -1],
    ];
    for (const [text, pct] of lines) {
      c.appendChild(el("div", text));
      if (pct >= 0) {
        const bar = el("div", undefined, "bar"), fill = el("div");
        fill.style.width = Math.min(100, pct).toFixed(0) + "%";
        bar.appendChild(fill);
        c.appendChild(bar);
      }
    }
    box.appendChild(c);
  }
}

function chart(canvas, lines, colors, fmt) {
  const g = canvas.getContext("2d"), w = canvas.width, h = canvas.height;
  g.clearRect(0, 0, w, h);
  let max = 0;
  for (const l of lines) for (const v of l) max = Math.max(max, v);
  if (max <= 0) max = 1;
  g.strokeStyle = "#e3e7ee"; g.fillStyle = "#6b7280"; g.font = "11px sans-serif";
  for (let i = 0; i <= 2; i++) {
    const y = 10 + (h - 20) * i / 2;
    g.beginPath(); g.moveTo(0, y); g.lineTo(w, y); g.stroke();
    g.fillText(fmt(max * (1 - i / 2)), 4, y - 2 + (i === 0 ? 10 : 0));
  }
  lines.forEach((l, k) => {
    g.strokeStyle = colors[k]; g.lineWidth = 2; g.beginPath();
    l.forEach((v, i) => {
      const x = w - (l.length - 1 - i) * (w / (HISTORY - 1)), y = 10 + (h - 20) * (1 - v / max);
      i ? g.lineTo(x, y) : g.moveTo(x, y);
    });
    g.stroke();
  });
}

function renderSandboxes(sbs, cpuPct, now) {
  const fNode = $("#f-node").value;
  const nsel = $("#f-node");
  for (const n of new Set(sbs.map((s) => s.node).filter(Boolean))) if (![...nsel.options].some((o) => o.value === n)) nsel.appendChild(new Option(n, n));
  const fState = $("#f-state").value, fBackend = $("#f-backend").value, fTenant = $("#f-tenant").value.trim(), fAge = Number($("#f-age").value || 0);
  const backends = new Set(sbs.map((s) => s.backend));
  const sel = $("#f-backend");
  for (const b of backends) if (![...sel.options].some((o) => o.value === b)) sel.appendChild(new Option(b, b));
  const body = $("#sandboxes tbody");
  body.replaceChildren();
  let shown = 0;
  for (const s of sbs) {
    const age = now - Date.parse(s.createdAt) / 1000;
    if (fState && s.state !== fState) continue;
    if (fNode && s.node !== fNode) continue;
    if (fBackend && s.backend !== fBackend) continue;
    if (fTenant && !(s.tenant || "").includes(fTenant)) continue;
    if (fAge < 0 && age >= -fAge) continue;
    if (fAge > 0 && age < fAge) continue;
    shown++;
    const mem = num(s.memoryBytes);
    const tr = row([
      s.id, s.node || "-", { t: s.state, cls: "state-" + s.state }, s.backend || "-", s.tenant || "-", { t: dur(age), cls: "num" },
      { t: cpuPct[s.id] !== undefined ? cpuPct[s.id].toFixed(1) + "%" : "", cls: "num" },
      { t: (mem >= 0 ? bytes(mem) : "?") + " / " + (num(s.memoryLimitBytes) ? bytes(num(s.memoryLimitBytes)) : "?"), cls: "num" },
      { t: s.commandsRunning ? "busy" : dur(num(s.idleMs) / 1000), cls: "num" },
      { t: String(s.commandsRunning || 0), cls: "num" },
    ]);
    tr.dataset.id = s.id;
    if (s.id === selected) tr.className = "selected";
    tr.addEventListener("click", () => openSandbox(s.id));
    body.appendChild(tr);
  }
  $("#sb-count").textContent = shown + " shown of " + sbs.length;
}

async function layers() {
  try {
    const r = await api("LayerService/ListLayers", {});
    const body = $("#layers tbody");
    body.replaceChildren();
    for (const l of r.layers || []) {
      body.appendChild(row([l.ref || l.name + ":" + l.version, (l.kind || "").replace("LAYER_KIND_", "").toLowerCase(),
        (l.digest || "").slice(0, 19), { t: bytes(num(l.size)), cls: "num" }, (l.createdAt || "").replace("T", " ").slice(0, 19)]));
    }
  } catch (e) {
    const body = $("#layers tbody");
    body.replaceChildren(row([e.code === "permission_denied" ? "This key may not list layers." : String(e.message)]));
  }
}

// --- one sandbox: commands, output, terminal ---

async function openSandbox(id) {
  if (selected !== id) closeTerminal();
  selected = id;
  $("#detail").hidden = false;
  $("#d-id").textContent = id;
  for (const tr of document.querySelectorAll("#sandboxes tbody tr")) tr.className = tr.dataset.id === id ? "selected" : "";
  await commands();
}

async function commands() {
  const id = selected;
  const body = $("#commands tbody");
  try {
    const r = await api("CommandService/ListCommands", { sandboxId: id });
    if (id !== selected) return;
    body.replaceChildren();
    const cmds = (r.commands || []).slice().reverse();
    for (const c of cmds) {
      const exit = c.exit ? (c.exit.signal || String(c.exit.code || 0)) : "";
      const tr = row([c.id, (c.args || []).join(" ").slice(0, 80), (c.state || "").replace("COMMAND_STATE_", "").toLowerCase(), exit,
        (c.startedAt || "").replace("T", " ").slice(0, 19)]);
      tr.addEventListener("click", () => output(id, c.id));
      body.appendChild(tr);
    }
    if (!cmds.length) body.appendChild(row(["no commands yet"]));
  } catch (e) {
    body.replaceChildren(row([String(e.message)]));
  }
}

async function output(sandboxId, commandId) {
  if (outputAbort) outputAbort.abort();
  outputAbort = new AbortController();
  const pre = $("#output");
  pre.textContent = "";
  $("#out-id").textContent = commandId;
  const dec = new TextDecoder();
  let shown = 0;
  const add = (b64) => {
    if (shown >= OUTPUT_MAX) return;
    const raw = atob(b64);
    const u = new Uint8Array(raw.length);
    for (let i = 0; i < raw.length; i++) u[i] = raw.charCodeAt(i);
    shown += u.length;
    pre.textContent += dec.decode(u, { stream: true });
    if (shown >= OUTPUT_MAX) pre.textContent += "\n[output past " + bytes(OUTPUT_MAX) + " not shown]";
  };
  try {
    await stream("CommandService/ConnectCommand", { sandboxId, commandId, offset: "0" }, (m) => {
      if (m.stdout) add(m.stdout);
      if (m.stderr) add(m.stderr);
      if (m.exit) pre.textContent += "\n[exit " + (m.exit.signal || m.exit.code || 0) + "]";
    }, outputAbort.signal);
  } catch (e) {
    if (e.name !== "AbortError") pre.textContent += "\n[" + e.message + "]";
  }
}

async function openTerminal() {
  closeTerminal();
  const id = selected;
  $("#terminal-box").hidden = false;
  const status = $("#terminal-status");
  term = new Terminal({ convertEol: false, fontSize: 13, cursorBlink: true });
  const fit = new FitAddon.FitAddon();
  term.loadAddon(fit);
  term.open($("#terminal"));
  fit.fit();
  window.shoalTerminal = term; // for tests: the buffer is read from here
  status.textContent = "connecting...";
  let t;
  try {
    const res = await fetch("/dash/ticket", { method: "POST", headers: { "Authorization": "Bearer " + token } });
    const data = await res.json();
    if (!res.ok) throw new Error(data.message || res.statusText);
    t = data.ticket;
  } catch (e) {
    status.textContent = "no terminal: " + e.message;
    return;
  }
  const proto = location.protocol === "https:" ? "wss:" : "ws:";
  const q = new URLSearchParams({ sandbox: id, ticket: t, rows: term.rows, cols: term.cols });
  const ws = new WebSocket(proto + "//" + location.host + "/dash/terminal?" + q);
  ws.binaryType = "arraybuffer";
  termSocket = ws;
  const enc = new TextEncoder();
  ws.onopen = () => { status.textContent = "connected to " + id; term.focus(); };
  ws.onmessage = (ev) => {
    if (typeof ev.data === "string") {
      const m = JSON.parse(ev.data);
      if (m.type === "exit") status.textContent = "shell exited (" + (m.signal || m.code || 0) + ")";
      return;
    }
    term.write(new Uint8Array(ev.data));
  };
  ws.onclose = (ev) => {
    if (termSocket === ws && !status.textContent.startsWith("shell exited")) status.textContent = "disconnected" + (ev.reason ? ": " + ev.reason : "");
    commands();
  };
  term.onData((d) => { if (ws.readyState === 1) ws.send(enc.encode(d)); });
  term.onResize(({ rows, cols }) => { if (ws.readyState === 1) ws.send(JSON.stringify({ type: "resize", rows, cols })); });
  commands();
}

function closeTerminal() {
  if (termSocket) { termSocket.close(); termSocket = null; }
  if (term) { term.dispose(); term = null; }
  $("#terminal-box").hidden = true;
}

// --- wiring ---

$("#login-form").addEventListener("submit", login);
$("#logout").addEventListener("click", logout);
$("#d-terminal").addEventListener("click", openTerminal);
$("#d-close").addEventListener("click", () => { closeTerminal(); selected = ""; $("#detail").hidden = true; });
for (const id of ["#f-state", "#f-node", "#f-backend", "#f-age"]) $(id).addEventListener("change", () => prev && poll0());
$("#f-tenant").addEventListener("input", () => prev && poll0());
function poll0() { clearTimeout(pollTimer); poll(); }
setInterval(() => { if (token && !$("#main-view").hidden) layers(); }, 15000);
show();
