// The dashboard's tables: members, the coverage map, checkpoints, events. Every string a member
// reports about itself goes into the page as text (textContent, attribute values), never as
// markup: the page builds its DOM with createElement only.
"use strict";

(function () {
  const si = (v) => window.Charts.si(v);

  // el("td", {class: "x", title: "..."}, child, ...): children are nodes or strings (as text)
  function el(tag, props, ...children) {
    const n = document.createElement(tag);
    for (const [k, v] of Object.entries(props || {})) {
      if (v === undefined || v === null || v === false) continue;
      if (k === "class") n.className = String(v);
      else if (k === "data") for (const [dk, dv] of Object.entries(v)) n.dataset[dk] = String(dv);
      else n.setAttribute(k, String(v));
    }
    for (const c of children.flat()) {
      if (c === undefined || c === null) continue;
      n.appendChild(typeof c === "object" ? c : document.createTextNode(String(c)));
    }
    return n;
  }

  const str = (v) => (v === undefined || v === null ? "" : typeof v === "string" ? v : JSON.stringify(v));
  const num = (v) => (typeof v === "number" && Number.isFinite(v) ? v : null);

  function short(id) {
    const s = str(id);
    return s.length > 16 ? `${s.slice(0, 8)}…${s.slice(-6)}` : s;
  }

  function peer(id, selfId) {
    return el("span", { class: "peer", title: str(id) }, short(id), id && id === selfId ? " (coordinator)" : null);
  }

  function ago(seconds) {
    if (!Number.isFinite(seconds)) return "–";
    const s = Math.max(0, seconds);
    if (s < 60) return `${Math.round(s)} s ago`;
    if (s < 3600) return `${Math.round(s / 60)} min ago`;
    if (s < 86400) return `${(s / 3600).toFixed(1)} h ago`;
    return `${(s / 86400).toFixed(1)} d ago`;
  }

  function bytes(v) {
    if (v === null) return "–";
    const t = si(v);  // "2.46M": "2.46 MB"
    return /[kMGT]$/.test(t) ? `${t.slice(0, -1)} ${t.slice(-1)}B` : `${t} B`;
  }

  function noneYet(colspan, what) {
    return el("tr", {}, el("td", { colspan: colspan, class: "empty" }, what || "none yet"));
  }

  function where(m) {
    if (m.stage !== null && m.stage !== undefined) return `#${str(m.stage)}`;
    if (m.expert !== null && m.expert !== undefined) return str(m.expert);
    return "";
  }

  function memberRow(m, st) {
    const caps = m.capabilities && typeof m.capabilities === "object" ? m.capabilities : {};
    const failed = m.failed ? str(m.failed) : "";
    const up = num(caps.up_mbps), down = num(caps.down_mbps);
    const link = [caps.relayed ? "relayed" : "direct", caps.client_mode ? "client" : null].filter(Boolean).join(", ");
    const sps = num(m.samples_per_second);
    return el("tr", { class: failed ? "failed" : null, data: { peerId: str(m.peer_id) } },
      el("td", {}, peer(m.peer_id, st.peer_id)),
      el("td", {}, el("span", { class: `role role-${str(m.role || "none").replace(/[^a-z]/g, "")}` }, str(m.role || "unassigned")),
        where(m) ? el("span", { class: "where" }, where(m)) : null),
      el("td", { class: "device", title: str(caps.device_name) }, str(caps.device || "?"),
        caps.device_name ? el("span", { class: "sub" }, str(caps.device_name)) : null),
      el("td", { class: "num" }, sps === null ? "–" : si(sps)),
      el("td", { class: "num" }, up === null && down === null ? "–" : `${up === null ? "?" : si(up)} / ${down === null ? "?" : si(down)}`),
      el("td", { class: "link" }, link),
      el("td", { class: "num" }, m.step === null || m.step === undefined ? "–" : str(m.step)),
      el("td", { class: "num" }, num(m.loss) === null ? "–" : m.loss.toFixed(3)),
      el("td", { class: "num" }, ago(st.now - m.last_seen)),
      el("td", { class: "version" }, str(caps.software || "?")),
      el("td", { class: failed ? "reason" : "ok" }, failed || (m.failed === undefined ? "–" : "ok")));
  }

  function members(st) {
    const list = Array.isArray(st.members) ? st.members : [];
    const order = { trainer: 0, stage: 1, expert: 1, replica: 2 };
    const sorted = list.slice().sort((a, b) => (order[a.role] ?? 3) - (order[b.role] ?? 3) || str(where(a)).localeCompare(str(where(b)), undefined, { numeric: true }) || str(a.peer_id).localeCompare(str(b.peer_id)));
    document.getElementById("members-body").replaceChildren(...(sorted.length ? sorted.map((m) => memberRow(m, st)) : [noneYet(11, "no members yet")]));
    const roles = {};
    for (const m of list) roles[m.role || "unassigned"] = (roles[m.role || "unassigned"] || 0) + 1;
    document.getElementById("members-count").textContent = `${list.length}` + (list.length ? ` · ${Object.entries(roles).map(([r, n]) => `${n} ${r}`).join(", ")}` : "");
  }

  // a cell per stage or shard: how many peers hold it (Petals' block map); a gap is red
  function cell(label, slot) {
    const peers = Array.isArray(slot.peers) ? slot.peers : [];
    const hashes = Array.isArray(slot.state_hashes) ? slot.state_hashes.length : 0;
    const kept = Array.isArray(slot.checkpoints) && slot.checkpoints.length ? slot.checkpoints[slot.checkpoints.length - 1].step : null;
    const cls = peers.length === 0 ? "gap" : peers.length === 1 ? "thin" : "held";
    return el("div", { class: `cell ${cls}`, title: peers.map(str).join("\n") || "no peer holds it", data: { peers: peers.length } },
      el("div", { class: "label" }, label),
      el("div", { class: "count" }, peers.length === 0 ? "gap" : `${peers.length} peer${peers.length > 1 ? "s" : ""}`),
      el("div", { class: "sub" }, num(slot.samples_per_second) === null ? "" : `${si(slot.samples_per_second)} samples/s`),
      hashes > 1 ? el("div", { class: "sub warn" }, `${hashes} states`) : null,
      kept !== null ? el("div", { class: "sub" }, `kept: step ${str(kept)}`) : null);
  }

  function coverage(st) {
    const stages = st.stages || {}, shards = st.expert_shards || {};
    const out = [];
    const byIndex = (a, b) => a.localeCompare(b, undefined, { numeric: true });
    if (Object.keys(stages).length) {
      out.push(el("div", { class: "map-title" }, "pipeline stages"), el("div", { class: "map" }, Object.keys(stages).sort(byIndex).map((k) => cell(`stage ${k}`, stages[k]))));
    }
    if (Object.keys(shards).length) {
      out.push(el("div", { class: "map-title" }, "expert shards"), el("div", { class: "map" }, Object.keys(shards).sort(byIndex).map((k) => cell(k, shards[k]))));
      if (st.dense && Array.isArray(st.dense.peers)) out.push(el("div", { class: "map" }, cell("trainers (dense)", st.dense)));
    }
    if (!out.length) {
      const replicas = (st.members || []).filter((m) => m.role === "replica").map((m) => m.peer_id);
      out.push(el("div", { class: "map-title" }, "replica mode: every replica holds the whole model"),
        el("div", { class: "map" }, cell("whole model", { peers: replicas, samples_per_second: (st.members || []).reduce((s, m) => s + (num(m.samples_per_second) || 0), 0) })));
    }
    document.getElementById("coverage").replaceChildren(...out);
  }

  function verified(c) {
    if (num(c.verified_by) !== null) return `✓ ${c.verified_by} replica${c.verified_by === 1 ? "" : "s"}`;
    if (c.quorum !== undefined) return `✓ ${str(c.quorum)}`;
    return "✓ quorum";
  }

  function checkpoints(st) {
    const rows = [];
    for (const c of (st.checkpoints || []).slice().reverse()) rows.push(["model", c]);
    for (const [name, group] of [["stage", st.stages || {}], ["", st.expert_shards || {}]]) {
      for (const [k, slot] of Object.entries(group)) {
        const list = (slot && slot.checkpoints) || [];
        if (list.length) rows.push([name ? `${name} ${k}` : k, list[list.length - 1]]);
      }
    }
    if (st.dense && Array.isArray(st.dense.checkpoints) && st.dense.checkpoints.length) rows.push(["dense", st.dense.checkpoints[st.dense.checkpoints.length - 1]]);
    document.getElementById("checkpoints-body").replaceChildren(...(rows.length ? rows.slice(0, 8).map(([what, c]) => el("tr", {},
      el("td", {}, what), el("td", { class: "num" }, str(c.step)),
      el("td", { class: "num" }, num(c.created_at) === null ? "–" : ago(st.now - c.created_at)),
      el("td", { class: "hash", title: str(c.state_hash) }, str(c.state_hash).slice(0, 12) || "–"),
      el("td", { class: "ok" }, verified(c)))) : [noneYet(5)]));
    const newest = (st.checkpoints || []).length ? st.checkpoints[st.checkpoints.length - 1].step : null;
    document.getElementById("export-step").textContent = newest === null ? "" : `; that checkpoint alone: DATA_DIR/checkpoints/step-${String(newest).padStart(8, "0")}`;
  }

  function events(st) {
    const list = Array.isArray(st.events) ? st.events.slice(-60).reverse() : null;
    const body = document.getElementById("events-body");
    if (!list || !list.length) {
      body.replaceChildren(noneYet(4));
      return;
    }
    body.replaceChildren(...list.map((e) => el("tr", { class: `event kind-${str(e.kind).replace(/[^a-z_]/g, "")}` },
      el("td", { class: "num" }, num(e.time) === null ? "" : window.Charts.clock(e.time)),
      el("td", {}, el("span", { class: "kind" }, str(e.kind))),
      el("td", {}, e.peer_id ? peer(e.peer_id, st.peer_id) : ""),
      el("td", { class: "detail" }, str(e.detail)))));
  }

  window.Sections = { el, str, num, short, ago, bytes, members, coverage, checkpoints, events };
})();
