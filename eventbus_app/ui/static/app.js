// eventbus job view: the page of `eventbus run --ui` and `eventbus view`.
// Vanilla JS, no build step, nothing fetched from elsewhere. Data from the server is only
// ever put into the page as text (textContent), never as HTML.
"use strict";

(function () {
  const MAX_EVENTS = 1000;     // events kept in the page
  const MAX_ROWS = 400;        // rows drawn after filtering
  const TERMINAL = { succeeded: 1, failed: 1, stopped: 1, preempted: 1 };

  const params = new URLSearchParams(window.location.search);
  const token = params.get("token");
  const withToken = (path) =>
    token ? path + (path.includes("?") ? "&" : "?") + "token=" + encodeURIComponent(token) : path;

  const $ = (id) => document.getElementById(id);
  const el = (tag, cls, text) => {
    const node = document.createElement(tag);
    if (cls) node.className = cls;
    if (text !== undefined && text !== null) node.textContent = String(text);
    return node;
  };

  let state = null;            // the latest /api/state
  let stateAt = 0;             // performance.now() when it arrived
  let events = [];             // recent events, oldest first
  let lastSeq = 0;
  let eventsDirty = true;
  let source = null;
  const rankNodes = new Map(); // rank -> its element

  // -- formatting ---------------------------------------------------------------------------
  function clock(t) {
    if (t === null || t === undefined) return "-";
    const d = new Date(t * 1000);
    const pad = (n, w) => String(n).padStart(w || 2, "0");
    return pad(d.getHours()) + ":" + pad(d.getMinutes()) + ":" + pad(d.getSeconds()) + "." +
      pad(d.getMilliseconds(), 3);
  }
  function short(s) {
    if (s < 10) return s.toFixed(1) + "s";
    if (s < 120) return Math.round(s) + "s";
    if (s < 7200) return Math.floor(s / 60) + "m" + String(Math.round(s % 60)).padStart(2, "0");
    return (s / 3600).toFixed(1) + "h";
  }
  function seconds(s) {
    if (s === null || s === undefined) return "-";
    if (s < 10) return s.toFixed(1) + " s";
    if (s < 120) return Math.round(s) + " s";
    if (s < 7200) return Math.floor(s / 60) + " min " + Math.round(s % 60) + " s";
    return (s / 3600).toFixed(1) + " h";
  }
  function secondsLeft(s) {
    // a drain's time left, as the server's sentences say it ("12 s", "2.5 s")
    s = Math.max(0, s);
    return (s >= 10 ? String(Math.round(s)) : s.toFixed(1).replace(/\.0$/, "")) + " s";
  }
  function liveSeconds() {
    // how far the page's clock moved since the state arrived (ages keep counting while
    // the job runs; a finished job's ages are fixed at its end)
    if (!state || TERMINAL[state.status]) return 0;
    return (performance.now() - stateAt) / 1000;
  }

  // -- the header -----------------------------------------------------------------------------
  function renderHeader() {
    const s = state;
    const status = $("status");
    status.dataset.status = s.status;
    status.textContent = s.status;
    $("attempt").textContent = s.attempt;
    $("restarts").textContent = s.restarts +
      (s.max_restarts !== null && s.max_restarts !== undefined ? " / " + s.max_restarts : "");
    $("events").textContent = s.events;
    $("world").textContent = s.world_size !== null && s.world_size !== undefined ?
      s.world_size : (s.ranks_total !== undefined ? s.ranks_total : s.ranks.length);
    $("run-id").textContent = s.run_id ? "run " + s.run_id : "";
    const src = $("source");
    src.textContent = s.source && s.source !== "live" ? s.source.split("/").pop() : "";
    src.title = s.source || "";
    document.title = "[" + s.status + "] eventbus job view" + (s.run_id ? " - " + s.run_id : "");
    renderGoodput();
    renderDrain();
    const reason = $("exit-reason");
    // a drained job's end is the drain banner's (its facts, not the agent's line)
    if (s.exit && s.status !== "succeeded" && s.status !== "preempted" && s.exit.reason) {
      reason.hidden = false;
      reason.textContent = (s.status === "stopped" ? "Stopped: " : "Failed: ") + s.exit.reason +
        (s.exit.exit_code !== null ? "  (exit code " + s.exit.exit_code + ")" : "");
    } else {
      reason.hidden = true;
    }
    const counts = $("state-counts");
    counts.replaceChildren();
    for (const name of ["running", "slow", "stalled", "late", "failed", "exited"]) {
      const n = s.states ? s.states[name] : 0;
      if (!n) continue;
      // data-count, not data-state: `[data-state=...]` finds rank elements only
      const c = el("span", "c", n + " " + name);
      c.dataset.count = name;
      c.title = "show only the " + name + " ranks (again: every rank)";
      c.addEventListener("click", () => {
        const input = $("rank-filter");
        input.value = input.value.trim() === name ? "" : name;
        setRankFilter(input.value);
      });
      counts.appendChild(c);
    }
    tickElapsed();
  }

  // -- goodput: "goodput 87.5% of 2 min 10 s; the biggest loss: restart, 9.8 s" ------------
  function renderGoodput() {
    const g = state.goodput;
    const node = $("goodput");
    if (!g) {
      node.textContent = "";
      node.removeAttribute("data-ratio");
      return;
    }
    node.textContent = g.sentence;
    node.dataset.ratio = String(g.goodput_ratio);
    const parts = Object.entries(g.badput_s || {}).filter(([, v]) => v > 0)
      .map(([k, v]) => k + " " + v.toFixed(1) + " s");
    node.title = "badput: " + (parts.join(", ") || "none") +
      (g.error_bound_s ? " (within " + Math.round(g.error_bound_s) + " s)" : "");
  }

  // -- a drain (preemption): "draining: SIGTERM on node 1, 12 s left", then how it ended ----
  function renderDrain() {
    const d = state.drain;
    const box = $("drain");
    if (!d || (state.status !== "draining" && state.status !== "preempted" && !d.active)) {
      box.hidden = true;
      box.dataset.phase = "none";
      return;
    }
    box.hidden = false;
    const draining = d.active && !TERMINAL[state.status];
    box.dataset.phase = draining ? "draining" : "preempted";
    box.dataset.late = d.late_ranks && d.late_ranks.length ? "true" : "false";
    let text = d.text;
    if (draining && d.left_s !== null && d.left_s !== undefined) {
      // the time left counts down between the server's states
      text = text.replace(/, [0-9.]+ s left$/, "") + ", " + secondsLeft(d.left_s - liveSeconds()) +
        " left";
    }
    $("drain-text").textContent = text;
    $("drain-detail").textContent = d.detail || "";
  }

  function tickElapsed() {
    if (state && state.drain && state.drain.active) renderDrain();
    if (!state || state.started === null || state.started === undefined) return;
    const end = state.ended !== null && state.ended !== undefined ? state.ended :
      state.now + liveSeconds();
    $("elapsed").textContent = "elapsed " + seconds(Math.max(0, end - state.started));
  }

  // -- the ranks ------------------------------------------------------------------------------
  // Up to BIG_ABOVE ranks every rank is a tile in #ranks. A larger job (the server then
  // sends compact rank entries) is drawn as a grid that makes elements only for the rows in
  // view (#rank-grid), with the ranks that need attention always drawn as tiles above it
  // (#attention): `[data-state="stalled"]` finds a stalled rank without scrolling.
  const BIG_ABOVE = 256;        // the server's COMPACT_ABOVE (eventbus_app/ui/state.py)
  const ATTENTION_MAX = 256;    // tiles drawn above the grid at most
  const CELL_W = 62, CELL_H = 32, CELL_GAP = 3;
  const OVERSCAN = 3;           // rows drawn beyond the visible ones, above and below
  // which ranks come first above the grid: the lower the sooner
  const SEVERITY = { stalled: 0, late: 1, failed: 2, slow: 3 };

  let big = false;              // drawn as the large-job grid
  let shown = [];               // the ranks (entries of state.ranks) the filter keeps
  let rankFilter = null;        // the parsed rank filter (null: every rank)
  let gridCols = 1;
  let gridDrawn = "";           // what the grid's window shows (a key: redraw when it changes)
  let firstDrawn = false;

  const nullish = (v) => v === null || v === undefined;

  function rankNode(rank) {
    let node = rankNodes.get(rank);
    if (node) return node;
    node = el("div", "rank");
    node.dataset.rank = String(rank);
    const top = el("div", "top");
    top.append(el("span", "num", rank), el("span", "st"));
    const l1 = el("div", "line");
    l1.append(el("span", "step"), el("span", "rs"));
    const l2 = el("div", "line");
    l2.append(el("span", "age"), el("span", "extra"));
    // what a silent rank is doing, by its last heartbeat ("saving checkpoint 45 s")
    node.append(top, l1, l2, el("div", "doing"));
    node.addEventListener("click", () => showRankDetail(rank));
    rankNodes.set(rank, node);
    return node;
  }

  function rankLabel(r) {
    let label = r.state;
    if (r.state === "failed") label = r.signal ? r.signal : "exit " + r.exit_code;
    if (r.state === "failed" && r.stopped_by_agent) label = "stopped";
    if (r.state === "slow" && r.slow_factor) label = "slow " + r.slow_factor.toFixed(1) + "x";
    if (r.state === "late") label = "late " + (r.signal || "");
    if (r.state === "exited" && r.drained) label = "drained";
    if ((r.state === "running" || r.state === "slow") && state.status === "draining") {
      label = "draining";
    }
    return label;
  }

  function rankTip(r) {
    // a compact entry (a large job) lacks attempt, pid, message, where and last_type:
    // a click on the rank fetches them (showRankDetail)
    const tip = ["rank " + r.rank + ": " + r.state];
    if (r.step !== null && r.step !== undefined) tip.push("step " + r.step);
    if (r.host) tip.push("host " + r.host + (r.pid ? " pid " + r.pid : ""));
    if (!nullish(r.attempt)) tip.push("attempt " + r.attempt);
    if (!nullish(r.exit_code)) tip.push("exit code " + r.exit_code + (r.signal ? " (" + r.signal + ")" : ""));
    if (r.state === "late") tip.push("did not stop within the drain's grace: its agent stopped it");
    else if (r.stopped_by_agent) tip.push("stopped by the agent: not a failure of its own");
    if (r.drained) tip.push("stopped by itself for the drain");
    if (r.message) tip.push(r.message);
    if (r.where) tip.push("at " + r.where);
    if (r.doing) tip.push(doingText(r));
    if (r.last_type || !nullish(r.last_event_age_s)) {
      tip.push("last event" + (r.last_type ? " " + r.last_type : "") +
               (nullish(r.last_event_age_s) ? "" : ", " + short(r.last_event_age_s) + " ago"));
    }
    return tip.join("\n");
  }

  // what a silent rank is doing and for how long: "saving checkpoint 45 s"
  function doingText(r) {
    return r.doing + (nullish(r.doing_s) ? "" : " " + seconds(r.doing_s));
  }

  function fillTile(node, r) {
    node.dataset.state = r.state;
    node.dataset.collateral = r.stopped_by_agent ? "true" : "false";
    node.dataset.drained = r.drained ? "true" : "false";
    node._age = nullish(r.last_event_age_s) ? null : r.last_event_age_s;
    node.querySelector(".st").textContent = rankLabel(r);
    node.querySelector(".step").textContent = !nullish(r.step) ? "step " + r.step : "step -";
    node.querySelector(".rs").textContent = r.restarts ? "\u21bb" + r.restarts : "";
    let extra = "";
    if (!nullish(r.idle_s) && r.idle_s >= 5 && r.state !== "exited" && r.state !== "failed") {
      extra = "idle " + short(r.idle_s);
    } else if (!nullish(r.epoch)) {
      extra = "ep " + r.epoch;
    }
    node.querySelector(".extra").textContent = extra;
    node.querySelector(".doing").textContent = r.doing ? doingText(r) : "";
    node.title = rankTip(r);
  }

  // the rank filter: terms separated by commas or spaces, a rank kept when it matches one:
  // a rank (12), a range (4096-4200), a state (stalled), else a part of its host's name
  function parseRankFilter(text) {
    const terms = text.toLowerCase().split(/[\s,]+/).filter(Boolean);
    if (!terms.length) return null;
    const ranges = [], states = new Set(), hosts = [];
    for (const t of terms) {
      const m = /^(\d+)(?:-(\d+))?$/.exec(t);
      if (m) ranges.push([Number(m[1]), m[2] !== undefined ? Number(m[2]) : Number(m[1])]);
      else if (t in STATE_NAMES) states.add(t);
      else hosts.push(t);
    }
    return { ranges, states, hosts };
  }
  const STATE_NAMES = { running: 1, stalled: 1, slow: 1, exited: 1, failed: 1, late: 1 };

  function keeps(f, r) {
    if (!f) return true;
    if (f.states.has(r.state)) return true;
    for (const [a, b] of f.ranges) if (r.rank >= a && r.rank <= b) return true;
    if (r.host) {
      const host = r.host.toLowerCase();
      for (const h of f.hosts) if (host.includes(h)) return true;
    }
    return false;
  }

  function renderRanks() {
    const wantBig = state.ranks.length > BIG_ABOVE;
    if (wantBig !== big) switchMode(wantBig);
    if (big) renderBig(); else renderSmall();
    tickAges();
    if (!firstDrawn) {
      firstDrawn = true;
      // for tests and the curious: when the page first showed its ranks
      if (window.performance && performance.mark) performance.mark("eventbus:ranks-drawn");
    }
  }

  function switchMode(toBig) {
    big = toBig;
    for (const node of rankNodes.values()) node.remove();
    rankNodes.clear();
    $("ranks").hidden = toBig;
    $("rank-grid").hidden = !toBig;
    $("attention").hidden = true;
    document.body.dataset.ranks = toBig ? "grid" : "tiles";
    gridDrawn = "";
  }

  function renderSmall() {
    const box = $("ranks");
    const seen = new Set();
    let previous = null;
    let count = 0;
    for (const r of state.ranks) {
      const node = rankNode(r.rank);
      seen.add(r.rank);
      fillTile(node, r);
      const keep = keeps(rankFilter, r);
      node.hidden = !keep;
      if (keep) count++;
      // keep rank order without re-creating elements
      const expected = previous ? previous.nextSibling : box.firstChild;
      if (expected !== node) box.insertBefore(node, expected);
      previous = node;
    }
    for (const [rank, node] of rankNodes) {
      if (!seen.has(rank)) { node.remove(); rankNodes.delete(rank); }
    }
    $("ranks-shown").textContent = rankFilter ? count + " of " + state.ranks.length + " shown" : "";
  }

  function renderBig() {
    // the ranks that need attention, most severe first, as tiles (never scrolled away)
    const urgent = [];
    for (const r of state.ranks) {
      if (r.state in SEVERITY) urgent.push(r);
    }
    const rankOf = (r) => SEVERITY[r.state] + (r.state === "failed" && r.stopped_by_agent ? 4 : 0);
    urgent.sort((a, b) => rankOf(a) - rankOf(b) || a.rank - b.rank);
    const box = $("attention");
    const seen = new Set();
    let previous = null;
    for (const r of urgent.slice(0, ATTENTION_MAX)) {
      const node = rankNode(r.rank);
      seen.add(r.rank);
      fillTile(node, r);
      const expected = previous ? previous.nextSibling : box.firstChild;
      if (expected !== node) box.insertBefore(node, expected);
      previous = node;
    }
    for (const [rank, node] of rankNodes) {
      if (!seen.has(rank)) { node.remove(); rankNodes.delete(rank); }
    }
    let more = $("attention-more");
    if (urgent.length > ATTENTION_MAX) {
      if (!more) { more = el("div", "more dim"); more.id = "attention-more"; }
      more.textContent = "... and " + (urgent.length - ATTENTION_MAX) +
        " more (filter by state to see them in the grid)";
      box.appendChild(more);
    } else if (more) {
      more.remove();
    }
    box.hidden = urgent.length === 0;
    // the grid: every rank the filter keeps, drawn only where it is in view
    shown = rankFilter ? state.ranks.filter((r) => keeps(rankFilter, r)) : state.ranks;
    $("ranks-shown").textContent = shown.length + " of " + state.ranks.length +
      " shown" + (urgent.length ? ", " + urgent.length + " need attention (above)" : "");
    gridDrawn = "";
    drawGrid();
  }

  function drawGrid() {
    if (!big) return;
    const view = $("rank-grid");
    const space = $("grid-space");
    const win = $("grid-window");
    const width = view.clientWidth || 600;
    gridCols = Math.max(1, Math.floor((width - CELL_GAP) / (CELL_W + CELL_GAP)));
    const rowH = CELL_H + CELL_GAP;
    const rows = Math.ceil(shown.length / gridCols);
    const maxH = Math.max(240, Math.round(window.innerHeight * 0.6));
    view.style.height = Math.min(maxH, rows * rowH + CELL_GAP + 2) + "px";
    space.style.height = (rows * rowH + CELL_GAP) + "px";
    const first = Math.max(0, Math.floor(view.scrollTop / rowH) - OVERSCAN);
    const last = Math.min(rows, Math.ceil((view.scrollTop + view.clientHeight) / rowH) + OVERSCAN);
    const key = first + ":" + last + ":" + gridCols + ":" + shown.length;
    if (key === gridDrawn) return;
    gridDrawn = key;
    win.style.top = (first * rowH) + "px";
    win.style.gridTemplateColumns = "repeat(" + gridCols + ", " + CELL_W + "px)";
    const begin = first * gridCols;
    const end = Math.min(shown.length, last * gridCols);
    const cells = win.children;
    let i = 0;
    for (let k = begin; k < end; k++, i++) {
      const r = shown[k];
      let cell = cells[i];
      if (!cell) {
        cell = el("div", "cell");
        cell.append(el("span", "n"), el("span", "s"));
        win.appendChild(cell);
      }
      const rank = String(r.rank);
      if (cell.dataset.rank !== rank) {
        cell.dataset.rank = rank;
        cell.firstChild.textContent = rank;
      }
      if (cell.dataset.state !== r.state) cell.dataset.state = r.state;
      cell.dataset.collateral = r.stopped_by_agent ? "true" : "false";
      const sub = r.state === "running" ? (nullish(r.step) ? "-" : "s " + r.step) : rankLabel(r);
      if (cell.lastChild.textContent !== sub) cell.lastChild.textContent = sub;
      cell.title = rankTip(r);
    }
    while (cells.length > i) win.lastChild.remove();
  }

  // a rank's whole entry (a large job's are compact): fetched when it is clicked
  function showRankDetail(rank) {
    const box = $("rank-detail");
    box.hidden = false;
    box.textContent = "rank " + rank + ": ...";
    fetch(withToken("api/state?ranks=" + rank), { credentials: "same-origin" })
      .then((r) => r.json())
      .then((s) => {
        const r = (s.ranks || [])[0];
        box.textContent = r ? rankTip(r).replace(/\n/g, " \u00b7 ") : "rank " + rank + ": not known";
      })
      .catch(() => { box.textContent = "rank " + rank + ": could not be fetched"; });
  }

  function setRankFilter(text) {
    rankFilter = parseRankFilter(text);
    const view = $("rank-grid");
    view.scrollTop = 0;
    if (state) renderRanks();
  }

  function tickAges() {
    const extra = liveSeconds();
    for (const node of rankNodes.values()) {
      const age = node._age;
      const span = node.querySelector(".age");
      if (age === null || age === undefined) { span.textContent = ""; continue; }
      const now = age + (node.dataset.state === "running" || node.dataset.state === "slow" ||
                         node.dataset.state === "stalled" ? extra : 0);
      span.textContent = short(now) + " ago";
      span.classList.toggle("old", now >= 30 && (node.dataset.state === "running"));
    }
  }

  // -- the attempts -----------------------------------------------------------------------------
  const ICONS = { failure: "\u2716", stall: "\u2016", slow: "\u25d4", restart: "\u21bb",
                  stop: "\u25a0", stopped: "\u00b7", end: "\u2716", node: "\u00b7",
                  drain: "\u25bc", preempted: "\u25a0", late: "\u2716", drained: "\u00b7" };

  function renderTimeline() {
    const box = $("timeline");
    const bar = $("timeline-bar");
    box.replaceChildren();
    bar.replaceChildren();
    const attempts = state.timeline || [];
    if (!attempts.length) { box.appendChild(el("p", "dim", "no attempt yet")); return; }
    const t0 = attempts[0].start;
    const now = state.ended !== null && state.ended !== undefined ? state.ended : state.now;
    const span = Math.max(1e-3, now - t0);
    for (const a of attempts) {
      const end = a.end !== null ? a.end : now;
      const seg = el("div", "seg");
      seg.dataset.outcome = a.outcome;
      seg.style.left = ((a.start - t0) / span * 100) + "%";
      seg.style.width = Math.max(0.3, (end - a.start) / span * 100) + "%";
      seg.title = "attempt " + a.attempt + ": " + a.outcome;
      bar.appendChild(seg);
      for (const m of a.marks) {
        if (!["failure", "stall", "slow", "restart", "stop", "drain", "late"].includes(m.kind)) continue;
        const tick = el("div", "tick");
        tick.dataset.kind = m.kind;
        tick.style.left = Math.min(99.5, Math.max(0, (m.t - t0) / span * 100)) + "%";
        tick.title = m.text;
        bar.appendChild(tick);
      }
    }
    const d = state.drain;
    if (d && d.started !== null && d.started !== undefined) {
      // the drain: hatched from its PREEMPTING to the job's end (or now)
      const until = d.ended !== null && d.ended !== undefined ? d.ended : now;
      const span2 = el("div", "drainspan");
      span2.style.left = Math.max(0, (d.started - t0) / span * 100) + "%";
      span2.style.width = Math.max(0.3, (until - d.started) / span * 100) + "%";
      span2.title = d.text;
      bar.appendChild(span2);
    }
    for (const a of attempts.slice().reverse()) {
      const row = el("div", "attempt");
      row.dataset.attempt = String(a.attempt);
      row.dataset.outcome = a.outcome;
      const end = a.end !== null ? a.end : now;
      const head = el("div", "head", "Attempt " + a.attempt + "  " + clock(a.start) + " \u2192 " +
        (a.end !== null ? clock(a.end) : "now") + "  (" + seconds(Math.max(0, end - a.start)) + ")");
      head.appendChild(el("span", "oc", a.outcome));
      row.appendChild(head);
      if (a.reason) row.appendChild(el("div", "reason", "after: " + a.reason));
      for (const m of a.marks) {
        const mark = el("div", "mark", (ICONS[m.kind] || "\u00b7") + " " + clock(m.t) + "  " + m.text);
        mark.dataset.kind = m.kind;
        row.appendChild(mark);
      }
      if (a.more_marks) row.appendChild(el("div", "mark dim", "... " + a.more_marks + " more"));
      if (a.stopped_by_agent) {
        const n = a.stopped_by_agent;
        const mark = el("div", "mark", "\u00b7 " + n + (n === 1 ? " rank" : " ranks") +
          " stopped by the agent after the failure");
        mark.dataset.kind = "stopped";
        row.appendChild(mark);
      }
      box.appendChild(row);
    }
  }

  // -- each restart's anatomy (RECOVERED): a bar per recovery, a segment per phase seen -----
  // Every bar is on one scale (the longest recovery fills the width); a phase not seen
  // (null) has no segment and is named after the label.
  const phaseName = (name) => name.replace(/_/g, " ");
  let recoveriesShown = null;

  function renderRecoveries() {
    const list = state.recoveries || [];
    const box = $("recoveries");
    const last = list[list.length - 1];
    // the list only grows at its end (its oldest go first): this says when it changed
    const key = last ? [list.length, list[0].attempt, last.attempt, last.total_s].join(":") : "";
    if (key === recoveriesShown) return;
    recoveriesShown = key;
    box.replaceChildren();
    box.hidden = !last;
    if (!last) return;
    const seen = (r) => Object.entries(r.phases || {}).filter(([, s]) => !nullish(s));
    const length = (r) => Math.max(r.total_s || 0,
      seen(r).reduce((sum, [, s]) => sum + Math.max(0, s), 0));
    const scale = Math.max(1e-9, ...list.map(length));
    const names = new Set();
    for (const r of list) for (const [name] of seen(r)) names.add(name);
    const legend = el("div", "rlegend dim", "restarts by phase:");
    for (const name of names) {
      const swatch = el("span", "sw");
      swatch.dataset.phase = name;
      const item = el("span", "item");
      item.append(swatch, phaseName(name));
      legend.appendChild(item);
    }
    box.appendChild(legend);
    for (const r of list.slice().reverse()) {
      const row = el("div", "recovery");
      row.dataset.attempt = String(r.attempt);
      const head = el("div", "rhead", "attempt " + r.attempt + " recovered" +
        (nullish(r.total_s) ? "" : " in " + r.total_s.toFixed(1) + " s"));
      const unseen = Object.entries(r.phases || {}).filter(([, s]) => nullish(s))
        .map(([name]) => phaseName(name));
      if (unseen.length) head.appendChild(el("span", "unseen", "not seen: " + unseen.join(", ")));
      const bar = el("div", "rbar");
      for (const [name, s] of seen(r)) {
        const seg = el("span", "ph");
        seg.dataset.phase = name;
        seg.style.width = (Math.max(0, s) / scale * 100) + "%";
        seg.title = phaseName(name) + " " + s.toFixed(2) + " s";
        bar.appendChild(seg);
      }
      row.append(head, bar);
      box.appendChild(row);
    }
  }

  // 0, 1, 2, 3, 5 -> "0-3, 5" (a large job's stall names thousands of waiting ranks)
  function rankRanges(list) {
    const ranks = list.filter((r) => typeof r === "number").sort((a, b) => a - b);
    const parts = [];
    for (let i = 0; i < ranks.length; i++) {
      let j = i;
      while (j + 1 < ranks.length && ranks[j + 1] <= ranks[j] + 1) j++;
      parts.push(ranks[i] === ranks[j] ? String(ranks[i]) : ranks[i] + "-" + ranks[j]);
      i = j;
    }
    const text = parts.join(", ");
    return text.length > 300 ? text.slice(0, 300) + "... (" + ranks.length + " ranks)" : text;
  }

  // -- the latest failure or stall ----------------------------------------------------------------
  let problemShown = null;
  function renderProblem() {
    const p = state.problem;
    const box = $("problem");
    const key = p ? p.seq : null;
    if (key === problemShown) return;
    problemShown = key;
    box.replaceChildren();
    box.dataset.kind = p ? p.kind : "none";
    if (!p) { box.appendChild(el("p", "dim", "none so far")); return; }
    box.appendChild(el("p", "diag", p.diagnosis || (p.kind + " of rank " + p.rank)));
    const meta = el("div", "meta");
    const fact = (label, value) => {
      if (value === null || value === undefined) return;
      const s = el("span", null, label + " ");
      s.appendChild(el("b", null, value));
      meta.appendChild(s);
    };
    fact("rank", p.rank);
    fact("attempt", p.attempt);
    fact("at", clock(p.t));
    fact("host", p.host);
    if (p.kind === "failure") {
      fact("exit code", p.exit_code);
      fact("signal", p.signal);
    }
    if (p.silent_s !== null && p.silent_s !== undefined) fact("silent", seconds(p.silent_s));
    if (p.culprit_ranks) fact("culprits", rankRanges(p.culprit_ranks));
    if (p.waiting_ranks) fact("waiting", rankRanges(p.waiting_ranks));
    if (p.collective) {
      const c = p.collective;
      fact("collective", [c.op, c.pg !== undefined ? "pg " + c.pg : null,
                          c.seq !== undefined ? "seq " + c.seq : null].filter(Boolean).join(" "));
    }
    box.appendChild(meta);
    if (p.message) {
      box.appendChild(el("h3", null, "message"));
      box.appendChild(el("pre", "message", p.message));
    }
    if (p.stack) {
      box.appendChild(el("h3", null, p.kind === "stall" ? "stack (culprit first)" : "stack"));
      box.appendChild(el("pre", "stack", p.stack));
    }
    if (p.peer_stacks) {
      for (const [rank, text] of Object.entries(p.peer_stacks)) {
        const d = el("details");
        d.appendChild(el("summary", null, "stack of rank " + rank));
        d.appendChild(el("pre", null, text));
        box.appendChild(d);
      }
    }
  }

  // -- drops ----------------------------------------------------------------------------------
  function renderDrops() {
    const d = state.drops || {};
    const box = $("drops");
    box.replaceChildren();
    const rows = [];
    const add = (what, reason, n) => rows.push([what, reason, n]);
    for (const l of d.lost || []) add("lost: " + l.source, l.reason, l.count);
    for (const s of d.sinks || []) {
      const dropped = s.dropped || {};
      const reasons = Object.keys(dropped);
      if (!reasons.length) add("sink " + s.name, "pending " + s.pending, 0);
      for (const r of reasons) add("sink " + s.name, r, dropped[r]);
    }
    const t = d.transport || {};
    for (const part of ["workers", "nodes"]) {
      if (!t[part]) continue;
      const lost = Object.assign({}, t[part].lost || {});
      for (const [r, n] of Object.entries(t[part].rejected || {})) lost["rejected: " + r] = n;
      const reasons = Object.keys(lost);
      if (!reasons.length) add("transport " + part, "delivered " + (t[part].delivered || 0), 0);
      for (const r of reasons) add("transport " + part, r, lost[r]);
    }
    if (t.job_forwarder) {
      const all = Object.assign({}, t.job_forwarder.dropped || {}, t.job_forwarder.lost || {});
      for (const [r, n] of Object.entries(all)) add("transport to group rank 0", r, n);
    }
    if (d.unreadable_lines) add("file", "unreadable lines", d.unreadable_lines);
    if (d.ranks_not_shown) add("view", "events of ranks not shown", d.ranks_not_shown);
    if (d.view_overflowed) add("view", "events beyond its backlog (lifecycle kept, steps and rows skipped)", d.view_overflowed);
    if (d.view_failed) add("view", "events it failed to fold (logged)", d.view_failed);
    if (d.counters_error) add("counters", d.counters_error, 0);
    if (!rows.length) { box.appendChild(el("p", "dim", "nothing dropped or lost")); return; }
    const table = el("table");
    for (const [what, reason, n] of rows) {
      const tr = el("tr", n ? "bad" : null);
      tr.append(el("td", null, what), el("td", "dim", reason), el("td", "n", n));
      table.appendChild(tr);
    }
    box.appendChild(table);
  }

  // -- recent events ------------------------------------------------------------------------------
  function addEvents(list, gap) {
    if (gap) {
      events.push({ seq: -1, t: null, type: "(gap)", who: "", level: "warn",
                    text: gap + " events not shown (the page fell behind)" });
    }
    for (const e of list) {
      if (e.seq > lastSeq) lastSeq = e.seq;
      events.push(e);
    }
    if (events.length > MAX_EVENTS) events = events.slice(events.length - MAX_EVENTS);
    eventsDirty = true;
  }

  function renderTypes() {
    const select = $("type-filter");
    const have = new Set(Array.from(select.options).map((o) => o.value));
    for (const name of Object.keys(state.types || {}).sort()) {
      if (have.has(name)) continue;
      const o = el("option", null, name);
      o.value = name;
      select.appendChild(o);
    }
  }

  function renderEvents() {
    if (!eventsDirty) return;
    eventsDirty = false;
    const text = $("filter").value.trim().toLowerCase();
    const type = $("type-filter").value;
    const problems = $("problems-only").checked;
    const body = $("events-body");
    const rows = [];
    for (let i = events.length - 1; i >= 0 && rows.length < MAX_ROWS; i--) {
      const e = events[i];
      if (type && e.type !== type) continue;
      if (problems && e.level === "info") continue;
      if (text) {
        const hay = (e.type + " " + e.who + " rank " + e.rank + " " + e.text + " " +
                     (e.host || "")).toLowerCase();
        if (!hay.includes(text)) continue;
      }
      const tr = el("tr");
      tr.dataset.level = e.level;
      tr.dataset.type = e.type;
      const who = e.who === "agent" && e.rank !== null && e.rank !== undefined ?
        "agent (rank " + e.rank + ")" : e.who;
      tr.append(el("td", null, clock(e.t)), el("td", null, who), el("td", null, e.type),
                el("td", "txt", e.text));
      rows.push(tr);
    }
    body.replaceChildren(...rows);
    $("events-shown").textContent = rows.length + " shown of " + events.length + " kept";
  }

  // -- the state ----------------------------------------------------------------------------
  function applyState(s) {
    state = s;
    stateAt = performance.now();
    renderHeader();
    renderRanks();
    renderTimeline();
    renderRecoveries();
    renderProblem();
    renderDrops();
    renderTypes();
    renderEvents();
    document.body.dataset.status = s.status;
    document.body.dataset.version = String(s.version);
  }

  function setConn(value, text) {
    const c = $("conn");
    c.dataset.conn = value;
    c.textContent = text || value;
  }

  function connect() {
    if (!window.EventSource) { setConn("error", "no EventSource: polling"); poll(); return; }
    source = new EventSource(withToken("api/stream?since=" + lastSeq));
    source.addEventListener("open", () => setConn("live"));
    source.addEventListener("events", (m) => {
      const msg = JSON.parse(m.data);
      addEvents(msg.events, msg.gap);
    });
    source.addEventListener("state", (m) => { setConn("live"); applyState(JSON.parse(m.data)); });
    source.addEventListener("end", () => {
      source.close();
      setConn("ended", "server closed: the job ended");
    });
    source.addEventListener("error", () => {
      if (source.readyState === EventSource.CLOSED) {
        setConn("ended", state && TERMINAL[state.status] ? "job ended" : "disconnected");
      } else {
        setConn("reconnecting", state && TERMINAL[state.status] ? "job ended" : "reconnecting");
      }
    });
  }

  function poll() {
    fetch(withToken("api/events?since=" + lastSeq), { credentials: "same-origin" })
      .then((r) => r.json()).then((msg) => { addEvents(msg.events, msg.gap); })
      .then(() => fetch(withToken("api/state"), { credentials: "same-origin" }))
      .then((r) => r.json()).then(applyState)
      .catch(() => setConn("error", "disconnected"))
      .finally(() => setTimeout(poll, 2000));
  }

  function start() {
    for (const id of ["filter", "type-filter", "problems-only"]) {
      $(id).addEventListener("input", () => { eventsDirty = true; renderEvents(); });
    }
    $("rank-filter").addEventListener("input", () => setRankFilter($("rank-filter").value));
    let drawing = false;
    const redraw = () => {
      if (drawing) return;
      drawing = true;
      requestAnimationFrame(() => { drawing = false; drawGrid(); });
    };
    $("rank-grid").addEventListener("scroll", redraw, { passive: true });
    $("grid-window").addEventListener("click", (e) => {
      const cell = e.target.closest(".cell");
      if (cell && cell.dataset.rank) showRankDetail(Number(cell.dataset.rank));
    });
    window.addEventListener("resize", () => { gridDrawn = ""; redraw(); });
    fetch(withToken("api/state?recent=" + MAX_EVENTS), { credentials: "same-origin" })
      .then((r) => {
        if (r.status === 401) throw new Error("a token is required: open the address eventbus printed");
        if (!r.ok) throw new Error("the server answered " + r.status);
        return r.json();
      })
      .then((s) => {
        addEvents(s.recent || [], 0);
        applyState(s);
        connect();
      })
      .catch((err) => setConn("error", String(err.message || err)));
    setInterval(() => { if (state) { tickAges(); tickElapsed(); } }, 1000);
  }

  if (document.readyState === "loading") document.addEventListener("DOMContentLoaded", start);
  else start();
})();
