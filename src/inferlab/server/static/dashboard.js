// The live dashboard: one snapshot a second pushed by /dashboard/events (SSE over fetch, so the
// API key can ride along), reconnecting when the stream drops; a request's trace; a bench file.
"use strict";

const HISTORY_S = 60;
const hist = []; // snapshots, oldest first
let eventsSeen = 0;

function setConn(ok, text) {
  const c = document.getElementById("conn");
  c.className = ok ? "live" : "down";
  c.textContent = text;
}

function pct(x) {
  return x === null || x === undefined ? "–" : (100 * x).toFixed(1) + " %";
}

function ms(x) {
  return x === null || x === undefined ? "–" : (1000 * x).toFixed(1);
}

function update(s) {
  eventsSeen += 1;
  document.body.dataset.events = String(eventsSeen);
  hist.push(s);
  while (hist.length && hist[0].time < s.time - HISTORY_S) hist.shift();
  const set = (id, v) => (document.getElementById(id).textContent = v);
  set("v-output", fmt(s.output_tokens_per_s));
  set("v-prompt", fmt(s.prompt_tokens_per_s));
  set("v-running", String(s.running));
  set("v-waiting", String(s.waiting));
  set("v-kv", pct(s.kv_cache_usage));
  set("v-hit", pct(s.prefix_cache_hit_rate));
  set("v-preempt", `${s.preemptions_last_minute} / ${s.preemptions_total}`);
  set("v-ttft", `${ms(s.ttft_s.p50)} / ${ms(s.ttft_s.p99)}`);
  set("v-itl", `${ms(s.itl_s.p50)} / ${ms(s.itl_s.p99)}`);
  set("v-finished", Object.entries(s.finished_last_minute).map(([k, v]) => `${v} ${k}`).join(", ") || "0");
  document.getElementById("updated").textContent = " updated " + new Date(s.time * 1000).toLocaleTimeString();
  const now = s.time;
  const pts = (f) => hist.map((h) => [h.time - now, f(h)]);
  const x = { xmin: -HISTORY_S, xmax: 0, xlabel: "seconds ago", xfmt: (v) => String(-v) };
  lineChart(document.getElementById("c-tokens"), [
    { name: "output tok/s", points: pts((h) => h.output_tokens_per_s) },
    { name: "prompt tok/s", points: pts((h) => h.prompt_tokens_per_s) },
  ], Object.assign({ title: "tokens per second" }, x));
  lineChart(document.getElementById("c-requests"), [
    { name: "running", points: pts((h) => h.running) },
    { name: "waiting", points: pts((h) => h.waiting) },
  ], Object.assign({ title: "requests", step: true }, x));
  lineChart(document.getElementById("c-kv"), [
    { name: "KV cache %", points: pts((h) => 100 * h.kv_cache_usage) },
    { name: "prefix hits %", points: pts((h) => (h.prefix_cache_hit_rate === null ? null : 100 * h.prefix_cache_hit_rate)) },
  ], Object.assign({ title: "KV cache", ymax: 100 }, x));
  lineChart(document.getElementById("c-latency"), [
    { name: "TTFT p50", points: pts((h) => (h.ttft_s.p50 === null ? null : 1000 * h.ttft_s.p50)) },
    { name: "TTFT p99", points: pts((h) => (h.ttft_s.p99 === null ? null : 1000 * h.ttft_s.p99)) },
    { name: "ITL p50", points: pts((h) => (h.itl_s.p50 === null ? null : 1000 * h.itl_s.p50)) },
    { name: "ITL p99", points: pts((h) => (h.itl_s.p99 === null ? null : 1000 * h.itl_s.p99)) },
  ], Object.assign({ title: "latency (ms)" }, x));
  const recent = document.getElementById("recent");
  recent.replaceChildren();
  for (const r of s.recent_requests || []) {
    const li = el("li", "", `${r.request_id} · ${r.finish_reason || "running"} · ${fmt(r.duration_ms)} ms`);
    li.dataset.id = r.request_id;
    li.addEventListener("click", () => showTrace(r.request_id));
    recent.appendChild(li);
  }
}

async function listen() {
  let delay = 1000;
  for (;;) {
    try {
      const resp = await apiFetch("/dashboard/events", { headers: { Accept: "text/event-stream" } });
      if (!resp.ok) throw new Error(await errorText(resp));
      setConn(true, "live");
      delay = 1000;
      await readSSE(resp, (s) => s !== "[DONE]" && update(s));
      setConn(false, "stream ended: reconnecting…");
    } catch (e) {
      setConn(false, "disconnected (" + e.message + "): reconnecting…");
    }
    await new Promise((r) => setTimeout(r, delay));
    delay = Math.min(delay * 2, 10000);
  }
}

async function showTrace(id) {
  const msg = document.getElementById("trace-msg");
  msg.className = "muted";
  msg.textContent = "loading " + id + "…";
  try {
    const resp = await apiFetch("/traces/" + encodeURIComponent(id));
    if (!resp.ok) throw new Error(await errorText(resp));
    const t = await resp.json();
    msg.textContent = `${t.request_id}: ${fmt(t.duration_ms)} ms, ${t.finish_reason || "running"}` +
      (t.complete ? "" : " (still running)") + (t.chunks_dropped ? `, ${t.chunks_dropped} more chunks not kept` : "");
    const svg = document.getElementById("trace-svg");
    svg.dataset.request = t.request_id; // shown first, so that it is drawn at its shown width
    ganttChart(svg, t.spans, "spans of " + t.request_id);
  } catch (e) {
    msg.className = "error";
    msg.textContent = "trace: " + e.message;
  }
}

// ---- a bench result file (schema inferlab.bench/1), drawn as bench/plots.py draws it
function okValues(run, col) {
  const req = run.requests;
  if (col === "itl_s") return req.status.flatMap((st, i) => (st === "ok" ? (req.itl_s[i] || []).filter((g) => g !== null) : []));
  return req.status.map((st, i) => (st === "ok" ? req[col][i] : null)).filter((v) => v !== null && v !== undefined);
}

function cdf(values) {
  const xs = values.map((v) => v * 1000).sort((a, b) => a - b);
  return xs.map((x, i) => [x, (i + 1) / xs.length]);
}

function percentile(values, q) {
  if (!values.length) return null;
  const s = values.slice().sort((a, b) => a - b);
  return s[Math.min(s.length - 1, Math.max(0, Math.ceil((q / 100) * s.length) - 1))];
}

function showBench(doc) {
  if (doc.schema !== "inferlab.bench/1" || !Array.isArray(doc.runs) || !doc.runs.length)
    throw new Error(`not an inferlab.bench/1 result (schema = ${JSON.stringify(doc.schema)})`);
  const model = (doc.server || {}).model;
  document.getElementById("bench-msg").textContent = `${doc.label}${model && model !== doc.label ? " (" + model + ")" : ""} · ${doc.created_utc} · ${doc.runs.length} run(s)`;
  const table = el("table", "summary");
  const head = table.appendChild(el("tr"));
  head.appendChild(el("th", "", ""));
  doc.runs.forEach((r) => head.appendChild(el("th", "", r.label)));
  const rows = [
    ["requests ok", (s) => s.completed], ["output tok/s", (s) => fmt(s.output_throughput)],
    ["requests/s", (s) => fmt(s.request_throughput, 2)], ["median TTFT ms", (s) => fmt(s.median_ttft_ms)],
    ["p99 TTFT ms", (s) => fmt(s.p99_ttft_ms)], ["median TPOT ms", (s) => fmt(s.median_tpot_ms)],
    ["median ITL ms", (s) => fmt(s.median_itl_ms)], ["median E2E ms", (s) => fmt(s.median_e2el_ms)],
  ];
  for (const [name, f] of rows) {
    const tr = table.appendChild(el("tr"));
    tr.appendChild(el("td", "", name));
    doc.runs.forEach((r) => tr.appendChild(el("td", "", String(f(r.summary)))));
  }
  document.getElementById("bench-summary").replaceChildren(table);
  const charts = document.getElementById("bench-charts");
  charts.replaceChildren();
  for (const [col, title] of [["ttft_s", "TTFT"], ["tpot_s", "TPOT"], ["itl_s", "ITL"], ["e2e_s", "E2E latency"]]) {
    const svg = charts.appendChild(svgEl("svg", { class: "chart bench-cdf", "data-col": col }));
    lineChart(svg, doc.runs.map((r) => ({ name: r.label, points: cdf(okValues(r, col)) })),
      { title: title + ": fraction of " + (col === "itl_s" ? "gaps" : "requests"), xlabel: "ms", ymin: 0, ymax: 1, step: true });
  }
  if (doc.sweep) {
    const kind = doc.sweep.kind || "concurrency";
    const xs = doc.runs.map((r) => (kind === "rate" ? r.load.request_rate : r.load.max_concurrency));
    const logx = Math.min(...xs) > 0 && Math.max(...xs) / Math.min(...xs) >= 8;
    const xlabel = kind === "rate" ? "request rate (req/s)" : "concurrency";
    const line = (f) => doc.runs.map((r, i) => [xs[i], f(r)]);
    const sw = charts.appendChild(svgEl("svg", { class: "chart bench-sweep" }));
    lineChart(sw, [{ name: "output tok/s", points: line((r) => r.summary.output_throughput) }], { title: "load sweep: output throughput", xlabel, dots: true, logx });
    const p95 = charts.appendChild(svgEl("svg", { class: "chart bench-sweep" }));
    lineChart(p95, [{ name: "p95 TTFT ms", points: line((r) => { const p = percentile(okValues(r, "ttft_s"), 95); return p === null ? null : 1000 * p; }) }],
      { title: "load sweep: p95 TTFT (ms)", xlabel, dots: true, logx });
  }
}

document.addEventListener("DOMContentLoaded", () => {
  setUpKeyForm();
  document.getElementById("bench-file").addEventListener("change", async (ev) => {
    const file = ev.target.files[0];
    if (!file) return;
    const msg = document.getElementById("bench-msg");
    msg.className = "";
    try {
      showBench(JSON.parse(await file.text()));
    } catch (e) {
      msg.className = "error";
      msg.textContent = file.name + ": " + e.message;
      document.getElementById("bench-summary").replaceChildren();
      document.getElementById("bench-charts").replaceChildren();
    }
  });
  const m = location.hash.match(/trace=([^&]+)/);
  if (m) showTrace(decodeURIComponent(m[1]));
  listen();
});
