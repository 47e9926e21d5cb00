// The dashboard: polls /status every second and renders it in place (no reload). Fields that an
// older coordinator does not send (throughput, events, a member's failed) show as "none yet".
"use strict";

(function () {
  const POLL_MS = 1000;
  const S = window.Sections, C = window.Charts;
  let lastOk = 0, lastError = "", drawn = null;

  function mode(st) {
    if (Object.keys(st.stages || {}).length) return "pipeline";
    if (Object.keys(st.expert_shards || {}).length) return "experts";
    return "replica";
  }

  function duration(s) {
    if (!Number.isFinite(s)) return "–";
    if (s < 120) return `${Math.round(s)} s`;
    if (s < 7200) return `${Math.round(s / 60)} min`;
    return s < 172800 ? `${(s / 3600).toFixed(1)} h` : `${(s / 86400).toFixed(1)} d`;
  }

  function header(st) {
    const run = st.run || {};
    document.getElementById("swarm-id").textContent = S.str(st.swarm_id);
    document.getElementById("run").textContent = [mode(st) + " mode", run.model ? `model ${S.str(run.model)}` : null,
      run.inner_steps && mode(st) === "replica" ? `H=${S.str(run.inner_steps)}` : null, `plan epoch ${S.str(st.epoch || 0)}`, `up ${duration(st.now - st.started_at)}`].filter(Boolean).join(" · ");
    document.title = `swarmtrain · ${S.str(st.swarm_id)}`;
  }

  function tile(label, value, sub, cls) {
    return S.el("div", { class: `tile ${cls || ""}` }, S.el("div", { class: "label" }, label), S.el("div", { class: "value" }, value), S.el("div", { class: "sub" }, sub || ""));
  }

  function losses(st) {
    return (Array.isArray(st.progress) ? st.progress : []).filter((p) => S.num(p.loss) !== null && S.num(p.step) !== null);
  }

  function tiles(st) {
    const members = Array.isArray(st.members) ? st.members : [];
    const steps = members.map((m) => S.num(m.step)).filter((v) => v !== null);
    const pts = losses(st);
    const last = pts.length ? pts[pts.length - 1].loss : null, first = pts.length ? pts[0].loss : null;
    const trend = last === null || pts.length < 2 ? "" : `${last <= first ? "▼" : "▲"} ${Math.abs(first - last).toFixed(3)} since step ${S.str(pts[0].step)}`;
    const sps = members.reduce((s, m) => s + (S.num(m.samples_per_second) || 0), 0);
    const tp = Array.isArray(st.throughput) && st.throughput.length ? st.throughput[st.throughput.length - 1] : null;
    const failed = members.filter((m) => m.failed).length;
    const ck = Array.isArray(st.checkpoints) && st.checkpoints.length ? st.checkpoints[st.checkpoints.length - 1] : null;
    document.getElementById("tiles").replaceChildren(
      tile("members", String(members.length), failed ? `${failed} failed` : `${S.str(st.evictions || 0)} evicted since start`, failed ? "bad" : ""),
      tile("step", steps.length ? String(Math.max(...steps)) : "–", "highest reported"),
      tile("loss", last === null ? "–" : last.toFixed(3), trend, last !== null && pts.length > 1 ? (last <= first ? "good" : "bad") : ""),
      tile("samples/s", C.si(sps), "members' sum"),
      tile("tokens/s", tp && S.num(tp.tokens_per_second) !== null ? C.si(tp.tokens_per_second) : "none yet", "swarm"),
      tile("bytes/s", tp && S.num(tp.bytes_per_second) !== null ? S.bytes(tp.bytes_per_second) : "none yet", "swarm, every plane"),
      tile("checkpoint", ck ? `step ${S.str(ck.step)}` : "none yet", ck && S.num(ck.created_at) !== null ? S.ago(st.now - ck.created_at) : ""));
  }

  function charts(st) {
    const pts = losses(st);
    // loss over steps: every point as a dot, the line through each step's mean (several members report a step)
    const bySteps = new Map();
    for (const p of pts) bySteps.set(p.step, (bySteps.get(p.step) || []).concat([p.loss]));
    const mean = [...bySteps.entries()].sort((a, b) => a[0] - b[0]).map(([s, l]) => [s, l.reduce((x, y) => x + y, 0) / l.length]);
    C.line(document.getElementById("chart-loss-steps"), [
      { name: "points", points: pts.map((p) => [p.step, p.loss]), dots: true, line: false, cls: "faint" },
      { name: "mean", points: mean, cls: "loss" },
    ], { counted: pts.length, yFormat: (v) => v.toFixed(2) });
    const byTime = pts.filter((p) => S.num(p.time) !== null).sort((a, b) => a.time - b.time);
    C.line(document.getElementById("chart-loss-time"), [{ name: "loss", points: byTime.map((p) => [p.time, p.loss]), dots: true, cls: "loss" }],
      { time: true, yFormat: (v) => v.toFixed(2) });
    const tp = (Array.isArray(st.throughput) ? st.throughput : []).filter((p) => S.num(p.time) !== null);
    C.line(document.getElementById("chart-tokens"), [{ name: "tokens/s", points: tp.map((p) => [p.time, S.num(p.tokens_per_second)]), cls: "tokens" }], { time: true, zero: true });
    C.line(document.getElementById("chart-bytes"), [{ name: "bytes/s", points: tp.map((p) => [p.time, S.num(p.bytes_per_second)]), cls: "bytes" }],
      { time: true, zero: true, yFormat: (v) => S.bytes(v) });
  }

  function render(st) {
    header(st);
    tiles(st);
    charts(st);
    S.members(st);
    S.coverage(st);
    S.checkpoints(st);
    S.events(st);
    drawn = st;
    document.body.dataset.renders = String(Number(document.body.dataset.renders || 0) + 1);
  }

  function freshness() {
    const live = document.getElementById("live");
    const age = (Date.now() - lastOk) / 1000;
    const stale = !lastOk || age > 3;
    live.className = stale ? "live stale" : "live";
    live.textContent = !lastOk ? (lastError ? `no status: ${lastError}` : "connecting…") : stale ? `stale: last status ${Math.round(age)} s ago${lastError ? ` (${lastError})` : ""}` : "live";
  }

  async function poll() {
    const abort = new AbortController();
    const timer = setTimeout(() => abort.abort(), 5000);
    try {
      const r = await fetch("/status", { cache: "no-store", signal: abort.signal });
      if (!r.ok) throw new Error(`HTTP ${r.status}`);
      const st = await r.json();
      lastOk = Date.now();
      lastError = "";
      render(st);
    } catch (e) {
      lastError = e && e.name === "AbortError" ? "timed out" : String((e && e.message) || e);
    } finally {
      clearTimeout(timer);
      freshness();
      setTimeout(poll, POLL_MS);
    }
  }

  window.addEventListener("resize", () => drawn && charts(drawn));
  setInterval(freshness, 500);
  poll();
})();
