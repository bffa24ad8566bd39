// Plain SVG charts: no library, nothing to bundle or audit, and a few hundred points a second
// redraw in well under a millisecond. Styling comes from style.css classes (the CSP forbids
// inline style attributes).
"use strict";

const SVG_NS = "http://www.w3.org/2000/svg";

function svgEl(tag, attrs, text) {
  const e = document.createElementNS(SVG_NS, tag);
  for (const k in attrs || {}) e.setAttribute(k, attrs[k]);
  if (text !== undefined) e.textContent = text;
  return e;
}

function niceTicks(lo, hi, n) {
  if (!(hi > lo)) hi = lo + 1;
  const raw = (hi - lo) / n;
  const mag = Math.pow(10, Math.floor(Math.log10(raw)));
  const step = [1, 2, 5, 10].map((m) => m * mag).find((s) => s >= raw) || mag * 10;
  const ticks = [];
  for (let v = Math.ceil(lo / step) * step; v <= hi + step * 1e-9; v += step) ticks.push(+v.toPrecision(12));
  return ticks;
}

function tickLabel(v) {
  const a = Math.abs(v);
  if (a >= 1e6) return (v / 1e6).toFixed(1) + "M";
  if (a >= 1e4) return (v / 1e3).toFixed(0) + "k";
  if (a >= 100 || a === 0) return v.toFixed(0);
  if (a >= 1) return +v.toFixed(1) + "";
  return +v.toPrecision(2) + "";
}

// series: [{name, points: [[x, y], ...]}]; opts: {title, xlabel, ymin, ymax, xmin, xmax, step, xfmt, logx}
function lineChart(svg, series, opts) {
  opts = opts || {};
  // drawn at the size it is shown (text stays 11 px), 520 x 190 before layout
  const W = Math.round(svg.clientWidth) || 520, H = Math.round(svg.clientHeight) || 190, L = 48, R = 12, T = 22, B = 30;
  svg.setAttribute("viewBox", `0 0 ${W} ${H}`);
  svg.replaceChildren();
  svg.appendChild(svgEl("text", { x: L, y: 14, class: "title" }, opts.title || ""));
  const pts = series.flatMap((s) => s.points.filter((p) => p[1] !== null && p[1] !== undefined && Number.isFinite(p[1])));
  const tx = (x) => (opts.logx ? Math.log2(x) : x);
  let xmin = opts.xmin !== undefined ? opts.xmin : Math.min(...pts.map((p) => p[0]));
  let xmax = opts.xmax !== undefined ? opts.xmax : Math.max(...pts.map((p) => p[0]));
  let ymin = opts.ymin !== undefined ? opts.ymin : Math.min(0, ...pts.map((p) => p[1]));
  let ymax = opts.ymax !== undefined ? opts.ymax : Math.max(...pts.map((p) => p[1]));
  if (!pts.length) { xmin = 0; xmax = 1; ymin = 0; ymax = 1; }
  if (!(ymax > ymin)) ymax = ymin + 1;
  if (!(xmax > xmin)) xmax = xmin + 1;
  const X0 = tx(xmin), X1 = tx(xmax);
  const sx = (x) => L + ((tx(x) - X0) / (X1 - X0 || 1)) * (W - L - R);
  const sy = (y) => H - B - ((y - ymin) / (ymax - ymin)) * (H - T - B);
  for (const v of niceTicks(ymin, ymax, 4)) {
    svg.appendChild(svgEl("line", { x1: L, x2: W - R, y1: sy(v), y2: sy(v), class: "grid" }));
    svg.appendChild(svgEl("text", { x: L - 4, y: sy(v) + 4, "text-anchor": "end" }, tickLabel(v)));
  }
  const xt = opts.logx ? niceTicks(X0, X1, 5).map((v) => Math.pow(2, v)) : niceTicks(xmin, xmax, 5);
  for (const v of xt) {
    if (v < xmin || v > xmax) continue;
    svg.appendChild(svgEl("text", { x: sx(v), y: H - B + 14, "text-anchor": "middle" }, opts.xfmt ? opts.xfmt(v) : tickLabel(v)));
  }
  svg.appendChild(svgEl("line", { x1: L, x2: W - R, y1: H - B, y2: H - B, class: "axis" }));
  svg.appendChild(svgEl("line", { x1: L, x2: L, y1: T, y2: H - B, class: "axis" }));
  if (opts.xlabel) svg.appendChild(svgEl("text", { x: W - R, y: H - 3, "text-anchor": "end" }, opts.xlabel));
  let lx = W - R;
  series.forEach((s, i) => {
    const cls = "s" + (i % 6);
    const good = s.points.filter((p) => p[1] !== null && p[1] !== undefined && Number.isFinite(p[1]));
    if (good.length) {
      let d = "";
      good.forEach((p, j) => {
        const x = sx(p[0]), y = sy(p[1]);
        if (opts.step && j > 0) d += ` H${x.toFixed(1)} V${y.toFixed(1)}`;
        else d += (j ? " L" : "M") + x.toFixed(1) + "," + y.toFixed(1);
      });
      svg.appendChild(svgEl("path", { d, class: "line " + cls, fill: "none" }));
      if (opts.dots) good.forEach((p) => svg.appendChild(svgEl("circle", { cx: sx(p[0]), cy: sy(p[1]), r: 3, class: cls })));
    }
    const label = svgEl("text", { x: lx, y: 14, "text-anchor": "end", class: cls }, s.name);
    svg.appendChild(label);
    lx -= 8 + 6.5 * s.name.length;
  });
}

// spans: [{name, start_ms, duration_ms, parent}] → one bar per row on a shared time axis.
function ganttChart(svg, spans, title) {
  const W = Math.round(svg.clientWidth) || 720, L = 110, R = 16, T = 24, row = 20;
  const H = T + row * spans.length + 26;
  svg.setAttribute("viewBox", `0 0 ${W} ${H}`);
  svg.setAttribute("height", H);
  svg.replaceChildren();
  svg.appendChild(svgEl("text", { x: 4, y: 15, class: "title" }, title || ""));
  const end = Math.max(1e-6, ...spans.map((s) => s.start_ms + s.duration_ms));
  const sx = (t) => L + (t / end) * (W - L - R);
  for (const v of niceTicks(0, end, 6)) {
    if (v > end) continue;
    svg.appendChild(svgEl("line", { x1: sx(v), x2: sx(v), y1: T - 4, y2: H - 22, class: "grid" }));
    svg.appendChild(svgEl("text", { x: sx(v), y: H - 8, "text-anchor": "middle" }, tickLabel(v) + " ms"));
  }
  const colour = { llm_request: "s5", queue: "s1", prefill: "s0", prefill_chunk: "s0", decode: "s2", finish: "s5", stream: "s3", abort: "s4", error: "s4" };
  spans.forEach((s, i) => {
    const y = T + i * row;
    const name = (s.parent && s.parent !== "llm_request" ? "  " : "") + s.name;
    svg.appendChild(svgEl("text", { x: 4, y: y + 14 }, name));
    const w = Math.max(1.5, sx(s.start_ms + s.duration_ms) - sx(s.start_ms));
    const bar = svgEl("rect", { x: sx(s.start_ms), y: y + 3, width: w, height: row - 6, class: "bar " + (colour[s.name] || "s5") });
    bar.appendChild(svgEl("title", {}, `${s.name}: ${s.duration_ms.toFixed(2)} ms (at ${s.start_ms.toFixed(2)} ms)` +
      Object.entries(s.attributes || {}).filter(([k]) => k !== "inferlab.phase").map(([k, v]) => `\n${k} = ${v}`).join("")));
    svg.appendChild(bar);
    const label = s.duration_ms.toFixed(1) + " ms";
    const inside = sx(s.start_ms) + w + 8 + 7 * label.length > W - R;  // no room after the bar: inside its end
    svg.appendChild(svgEl("text", inside ? { x: sx(s.start_ms) + w - 4, y: y + 14, "text-anchor": "end", class: "inbar" }
      : { x: sx(s.start_ms) + w + 4, y: y + 14 }, label));
  });
}
