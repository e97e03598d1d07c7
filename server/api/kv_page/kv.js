// The /kv page: polls kv/state for snapshots, listens to kv/events for the step log.
// Plain JS, no build step, no third-party code: it must work from the pod through a port-forward.
"use strict";

const POLL_MS = 500;
const MAX_FRAMES = 300;   // snapshots kept for stepping back through history
const MAX_EVENTS = 2000;  // log entries kept
const MAX_CELLS = 16384;  // blocks drawn in the grid

const kv = {
  frames: [],      // {state, at}
  view: null,      // index into frames while paused; null = live
  events: [],      // oldest first
  lastSeq: -1,
  dropped: 0,
  source: null,
};
window.kv = kv;

const $ = (id) => document.getElementById(id);
const fmt = (n, digits = 0) => (n === null || n === undefined ? "–" : Number(n).toLocaleString("en-US", { maximumFractionDigits: digits }));
const pct = (x, digits = 1) => (x === null || x === undefined ? "–" : (100 * x).toFixed(digits) + " %");

function si(value, unit) {
  if (!value) return "0 " + unit;
  const prefixes = ["", "k", "M", "G", "T", "P"];
  let i = 0;
  while (Math.abs(value) >= 1000 && i < prefixes.length - 1) { value /= 1000; i++; }
  return value.toFixed(value < 10 ? 2 : 1) + " " + prefixes[i] + unit;
}

function colour(owner) {
  if (!owner) return "#94a3b8";
  let h = 0;
  for (const c of owner) h = (h * 31 + c.charCodeAt(0)) >>> 0;
  return `hsl(${h % 360}, 62%, 46%)`;
}

function addEvents(list) {
  for (const e of list) {
    if (e.id <= kv.lastSeq) continue;
    kv.events.push(e);
    kv.lastSeq = e.id;
  }
  if (kv.events.length > MAX_EVENTS) kv.events.splice(0, kv.events.length - MAX_EVENTS);
}

function current() {
  if (!kv.frames.length) return null;
  return kv.frames[kv.view === null ? kv.frames.length - 1 : kv.view].state;
}

async function refresh() {
  const response = await fetch("kv/state", { cache: "no-store" });
  if (!response.ok) throw new Error(`kv/state: ${response.status}`);
  const state = await response.json();
  kv.frames.push({ state, at: Date.now() });
  if (kv.frames.length > MAX_FRAMES) {
    kv.frames.shift();
    if (kv.view !== null) kv.view = Math.max(0, kv.view - 1);
  }
  addEvents(state.recent_events);
  if (!kv.source) listen(state.counters.events_recorded);
  render();
  return state;
}
kv.refresh = refresh;

function listen(since) {
  kv.source = new EventSource(`kv/events?since=${since}`);
  kv.source.addEventListener("kv", (message) => {
    addEvents([JSON.parse(message.data)]);
    if (kv.view === null) renderLog(current());
  });
  kv.source.addEventListener("dropped", (message) => {
    kv.dropped += JSON.parse(message.data).dropped;
    $("dropped").textContent = fmt(kv.dropped);
  });
}

function render() {
  const state = current();
  if (!state) return;
  const frame = kv.view === null ? "live" : `snapshot ${kv.view + 1} of ${kv.frames.length} (step ${state.step})`;
  $("frame").textContent = frame;
  $("pause").textContent = kv.view === null ? "Pause" : "Resume";
  $("model").textContent = `· ${state.model} · step ${state.step}`;
  renderHeadline(state);
  renderGrid(state);
  renderRequests(state);
  renderLog(state);
}
kv.render = render;

function renderHeadline(state) {
  const h = state.headline;
  $("used").textContent = h.blocks_used;
  $("total").textContent = state.num_blocks;
  $("cached").textContent = h.blocks_cached;
  $("free").textContent = h.blocks_free;
  $("shared").textContent = h.blocks_shared;
  $("usage").textContent = pct(h.usage);
  $("usage-bar").style.width = Math.min(100, 100 * h.usage) + "%";
  $("usage-bar").style.background = h.usage > h.usage_target ? "#dc2626" : "#3b82f6";
  $("target-line").style.left = 100 * h.usage_target + "%";
  $("target").textContent = pct(h.usage_target, 0);
  $("capacity-tokens").textContent = fmt(h.capacity_tokens);
  $("capacity-seqs").textContent = fmt(h.capacity_seqs_at_mean_len);
  $("mean-len").textContent = fmt(h.mean_seq_tokens, 1);
  $("waste").textContent = h.waste_pct.toFixed(1) + " %";
  $("waste-slots").textContent = fmt(h.waste_slots);
  const r = state.roofline;
  const s = r.last_step;
  $("roofline-peaks").textContent =
    `peaks (${r.peak_source === "probe" ? "measured at start-up" : r.peak_source}): ` +
    `${si(r.peak_bytes_per_s, "B/s")}, ${si(r.peak_flops_per_s, "FLOP/s")}; ridge ${r.ridge_intensity.toFixed(1)} FLOP/B · ` +
    `steps so far: ${fmt(r.bound_steps.memory)} memory-bound, ${fmt(r.bound_steps.compute)} compute-bound`;
  if (!s) { $("bound").textContent = "no step yet"; $("roofline").textContent = ""; return; }
  $("bound").textContent = `${s.bound}-bound`;
  $("roofline").textContent =
    `${s.tokens} tokens in ${(1000 * s.seconds).toFixed(1)} ms · moved ${si(s.bytes, "B")} ` +
    `(weights ${si(s.weight_bytes, "B")}, KV read ${si(s.kv_read_bytes, "B")}, KV written ${si(s.kv_write_bytes, "B")}) ` +
    `→ ${si(s.bytes_per_s, "B/s")} = ${pct(s.bandwidth_utilization)} of peak bandwidth · ` +
    `${si(s.flops, "FLOP")} → ${si(s.flops_per_s, "FLOP/s")} = ${pct(s.compute_utilization)} of peak compute · ` +
    `intensity ${s.intensity.toFixed(1)} FLOP/B`;
}

function renderGrid(state) {
  const grid = $("grid");
  const b = state.blocks;
  const n = Math.min(state.num_blocks, MAX_CELLS);
  const small = n > 1024;
  while (grid.children.length < n) {
    const cell = document.createElement("div");
    cell.innerHTML = '<div class="fill"></div><span class="ref"></span>';
    grid.appendChild(cell);
  }
  while (grid.children.length > n) grid.lastChild.remove();
  for (let i = 0; i < n; i++) {
    const cell = grid.children[i];
    const st = b.state[i];
    cell.className = `block ${st}${small ? " small" : ""}`;
    cell.dataset.block = i;
    cell.dataset.ref = b.ref_count[i];
    cell.dataset.owner = b.owner[i] || "";
    const fill = cell.firstChild;
    fill.style.height = st === "used" ? (100 * b.filled[i]) / state.block_size + "%" : "0";
    fill.style.background = colour(b.owner[i]);
    cell.lastChild.textContent = b.ref_count[i] > 1 ? b.ref_count[i] : "";
    cell.title = `block ${i} · ${st}` + (b.owner[i] ? ` · ${b.owner[i]}` : "") +
      ` · ref ${b.ref_count[i]} · ${b.filled[i]}/${state.block_size} slots`;
  }
  $("grid-note").textContent = state.num_blocks > n ? `first ${n} of ${fmt(state.num_blocks)} blocks` : "";
}

function renderRequests(state) {
  const body = document.querySelector("#requests tbody");
  body.replaceChildren();
  for (const r of state.requests) {
    for (const s of r.seqs) {
      const row = document.createElement("tr");
      row.dataset.request = r.id;
      const table = s.block_table.map((p, l) => `${l}→${p}`).join(" ");
      const cells = [
        `${r.id}${r.seqs.length > 1 ? " #" + s.index : ""}`,
        r.status, s.prompt_tokens, s.output_tokens, `${s.tokens_in_cache} (${s.empty_slots} empty slots)`,
        r.prefix_hit_tokens ? `${r.prefix_hit_tokens} tokens` : "–", table,
      ];
      for (const [j, text] of cells.entries()) {
        const td = document.createElement("td");
        td.textContent = text;  // ids come from clients' requests: never parsed as HTML
        if (j === 0) {
          const swatch = document.createElement("span");
          swatch.className = "swatch";
          swatch.style.background = colour(r.id);
          td.prepend(swatch);
        }
        if (j === 6) td.className = "table";
        row.appendChild(td);
      }
      body.appendChild(row);
    }
  }
  if (!state.requests.length) body.innerHTML = '<tr><td colspan="7" class="sub">no request holds blocks</td></tr>';
}

function describeEvent(e) {
  const who = e.req ? ` ${e.req}` : "";
  const blocks = (list) => (list.length > 6 ? `${list.slice(0, 6).join(", ")}… (${list.length})` : list.join(", "));
  switch (e.kind) {
    case "alloc": return `${who}: blocks ${blocks(e.blocks)} at logical ${e.index}`;
    case "cow": return `${who}: block ${e.src} → copy ${e.dst} (logical ${e.index})`;
    case "fork": return `${who}: seq ${e.child_seq_id} shares ${e.blocks.length} blocks of seq ${e.seq_id}`;
    case "prefix_hit": return `${who}: ${e.tokens} tokens from cached blocks ${blocks(e.blocks)}`;
    case "cache": return `${who}: blocks ${blocks(e.blocks)} hashed`;
    case "free": return `${who}: ${e.blocks.length} blocks released (${e.cached.length} keep cached content)`;
    case "evict": return `: block ${e.block}`;
    case "preempt": return `${who}`;
    case "reset": return `: ${e.blocks.length} blocks`;
    default: return "";
  }
}

function renderLog(state) {
  if (!state) return;
  const log = $("log");
  const upto = state.counters.events_recorded; // events that had happened by this snapshot
  const items = [];
  for (let i = kv.events.length - 1; i >= 0 && items.length < 200; i--) {
    const e = kv.events[i];
    const li = document.createElement("li");
    li.dataset.kind = e.kind;
    if (kv.view !== null && e.id >= upto) li.className = "later"; // after the snapshot on show
    li.innerHTML = `<span class="sub">step ${e.step}</span> <span class="kind ${e.kind}"></span><span class="detail"></span>` +
      '<span class="what"></span><span class="term"></span>';
    li.querySelector(".kind").textContent = e.kind.replace("_", " ");
    li.querySelector(".detail").textContent = describeEvent(e);
    const meaning = state.kinds[e.kind];
    li.querySelector(".what").textContent = meaning.what;
    li.querySelector(".term").textContent = "paper: " + meaning.term;
    items.push(li);
  }
  log.replaceChildren(...items);
}

$("pause").addEventListener("click", () => {
  kv.view = kv.view === null ? Math.max(0, kv.frames.length - 1) : null;
  render();
});
$("back").addEventListener("click", () => {
  if (!kv.frames.length) return;
  kv.view = Math.max(0, (kv.view === null ? kv.frames.length - 1 : kv.view) - 1);
  render();
});
$("forward").addEventListener("click", () => {
  if (kv.view === null) return;
  kv.view = kv.view + 1 >= kv.frames.length ? null : kv.view + 1;
  render();
});

async function loop() {
  try { await refresh(); } catch (error) { $("frame").textContent = String(error); }
  setTimeout(loop, POLL_MS);
}
loop();
