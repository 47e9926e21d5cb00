// Small SVG line charts for the dashboard: no library, nothing fetched. Charts.line(container,
// series, options) draws into `container` (replacing what was there) and records how many
// points it plotted in container.dataset.points.
"use strict";

(function () {
  const SVG = "http://www.w3.org/2000/svg";
  const PAD = { left: 46, right: 10, top: 8, bottom: 20 };

  function node(tag, attrs, parent) {
    const n = document.createElementNS(SVG, tag);
    for (const [k, v] of Object.entries(attrs || {})) n.setAttribute(k, String(v));
    if (parent) parent.appendChild(n);
    return n;
  }

  function text(parent, x, y, value, cls, anchor) {
    const t = node("text", { x: x, y: y, class: cls || "tick", "text-anchor": anchor || "middle" }, parent);
    t.textContent = value;
    return t;
  }

  // about `count` round ticks covering [lo, hi]
  function ticks(lo, hi, count, steps) {
    const span = hi - lo;
    if (!(span > 0)) return [lo];
    const raw = span / Math.max(1, count);
    let step;
    if (steps) {
      step = steps.find((s) => s >= raw) || steps[steps.length - 1] * Math.ceil(raw / steps[steps.length - 1]);
    } else {
      const mag = Math.pow(10, Math.floor(Math.log10(raw)));
      step = [1, 2, 2.5, 5, 10].map((m) => m * mag).find((s) => s >= raw);
    }
    const out = [];
    for (let v = Math.ceil(lo / step) * step; v <= hi + step * 1e-9; v += step) out.push(+v.toPrecision(12));
    return out;
  }

  const TIME_STEPS = [1, 2, 5, 10, 15, 30, 60, 120, 300, 600, 900, 1800, 3600, 7200, 10800, 21600, 43200, 86400];

  function si(v) {
    if (!Number.isFinite(v)) return "–";
    const a = Math.abs(v);
    for (const [d, s] of [[1e12, "T"], [1e9, "G"], [1e6, "M"], [1e3, "k"]]) {
      if (a >= d) return +(v / d).toPrecision(3) + s;
    }
    if (a === 0) return "0";
    return a >= 0.01 ? String(+v.toPrecision(3)) : v.toExponential(1);
  }

  function clock(t) {
    const d = new Date(t * 1000);
    return [d.getHours(), d.getMinutes(), d.getSeconds()].map((n) => String(n).padStart(2, "0")).join(":");
  }

  function extent(values) {
    let lo = Infinity, hi = -Infinity;
    for (const v of values) {
      if (v < lo) lo = v;
      if (v > hi) hi = v;
    }
    if (lo === hi) { lo -= lo === 0 ? 1 : Math.abs(lo) * 0.05; hi += hi === 0 ? 1 : Math.abs(hi) * 0.05; }
    return [lo, hi];
  }

  // series: [{name, points: [[x, y], ...], cls, dots}]; options: {time (x is seconds since the
  // epoch), yFormat, empty (the words shown with no point), counted (how many points to record;
  // default: every point of every series)}
  function line(container, series, options) {
    const opt = options || {};
    const pts = series.flatMap((s) => s.points).filter((p) => Number.isFinite(p[0]) && Number.isFinite(p[1]));
    container.dataset.points = String(opt.counted !== undefined ? opt.counted : pts.length);
    container.replaceChildren();
    if (!pts.length) {
      const empty = document.createElement("div");
      empty.className = "empty";
      empty.textContent = opt.empty || "none yet";
      container.appendChild(empty);
      return;
    }
    const W = Math.max(200, container.clientWidth || 320), H = Math.max(100, container.clientHeight || 150);
    const svg = node("svg", { width: W, height: H, viewBox: `0 0 ${W} ${H}`, class: "plot" }, container);
    const [x0, x1] = extent(pts.map((p) => p[0]));
    const [ylo, yhi] = extent(pts.map((p) => p[1]));
    const y0 = opt.zero && ylo > 0 ? 0 : ylo, y1 = yhi + (yhi - y0) * 0.05;
    const iw = W - PAD.left - PAD.right, ih = H - PAD.top - PAD.bottom;
    const sx = (x) => PAD.left + ((x - x0) / (x1 - x0)) * iw;
    const sy = (y) => PAD.top + ih - ((y - y0) / (y1 - y0)) * ih;
    const yFormat = opt.yFormat || si;
    for (const v of ticks(y0, y1, 4)) {
      node("line", { x1: PAD.left, x2: W - PAD.right, y1: sy(v), y2: sy(v), class: "grid" }, svg);
      text(svg, PAD.left - 5, sy(v) + 4, yFormat(v), "tick", "end");
    }
    const xt = ticks(x0, x1, Math.max(2, Math.floor(iw / 80)), opt.time ? TIME_STEPS : null);
    for (const v of xt) {
      if (!opt.time && !Number.isInteger(v) && x1 - x0 >= 2) continue;  // steps are whole
      node("line", { x1: sx(v), x2: sx(v), y1: PAD.top + ih, y2: PAD.top + ih + 4, class: "axis" }, svg);
      const label = opt.time ? clock(v) : si(v), room = label.length * 3.3;  // (half its width at 10 px)
      text(svg, Math.min(sx(v), W - 1), H - 5, label, "tick", sx(v) + room > W ? "end" : sx(v) - room < 0 ? "start" : "middle");
    }
    node("line", { x1: PAD.left, x2: W - PAD.right, y1: PAD.top + ih, y2: PAD.top + ih, class: "axis" }, svg);
    for (const s of series) {
      const p = s.points.filter((q) => Number.isFinite(q[0]) && Number.isFinite(q[1]));
      if (!p.length) continue;
      if (s.dots) {
        const g = node("g", { class: "dots " + (s.cls || "") }, svg);
        for (const q of p) node("circle", { cx: sx(q[0]).toFixed(1), cy: sy(q[1]).toFixed(1), r: 1.8 }, g);
      }
      if (s.line !== false && p.length > 1) {
        node("polyline", { class: "series " + (s.cls || ""), points: p.map((q) => `${sx(q[0]).toFixed(1)},${sy(q[1]).toFixed(1)}`).join(" ") }, svg);
      }
      const last = p[p.length - 1];
      const end = node("circle", { cx: sx(last[0]), cy: sy(last[1]), r: 3, class: "end " + (s.cls || "") }, svg);
      node("title", {}, end).textContent = `${s.name || ""} ${yFormat(last[1])}`.trim();
    }
  }

  window.Charts = { line: line, si: si, clock: clock };
})();
