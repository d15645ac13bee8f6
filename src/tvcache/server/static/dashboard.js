// The tvcache dashboard: plain JavaScript and SVG, no dependencies. All data is rendered as text
// (textContent / SVG attributes), never as HTML: cached tool outputs are arbitrary bytes from sandboxes.
"use strict";

const TOKEN_KEY = "tvcache.token";
const SVG_NS = "http://www.w3.org/2000/svg";
const REFRESH_MS = 5000;
const OUTLINE_LIMIT = 2000;

const state = {
  task: null, // selected task id
  activity: null, // last /v1/activity
  outline: null, // last /v1/graph/outline of the selected task
  outlineKey: "", // what the drawn graph was drawn from
  selected: null, // selected node id
  view: null, // the graph's viewBox {x, y, w, h}
  bounds: null, // the drawn graph's extent
  timer: null,
};

// ------------------------------------------------------------------ helpers

const $ = (id) => document.getElementById(id);

function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(attrs || {})) {
    if (key === "class") node.className = value;
    else if (key.startsWith("data-")) node.setAttribute(key, value);
    else node[key] = value;
  }
  for (const child of children) node.append(child instanceof Node ? child : document.createTextNode(String(child)));
  return node;
}

function svg(tag, attrs, ...children) {
  const node = document.createElementNS(SVG_NS, tag);
  for (const [key, value] of Object.entries(attrs || {})) node.setAttribute(key, String(value));
  for (const child of children) node.append(child instanceof Node ? child : document.createTextNode(String(child)));
  return node;
}

function pct(rate) {
  return rate === null || rate === undefined ? "\u2013" : (rate * 100).toFixed(1) + "%";
}

function seconds(value) {
  if (value === 0) return "0 s";
  if (value < 1) return (value * 1000).toFixed(value < 0.01 ? 2 : 0) + " ms";
  if (value < 120) return value.toFixed(1) + " s";
  if (value < 7200) return (value / 60).toFixed(1) + " min";
  return (value / 3600).toFixed(1) + " h";
}

function bytes(value) {
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let unit = 0;
  while (value >= 1024 && unit < units.length - 1) { value /= 1024; unit += 1; }
  return (unit ? value.toFixed(1) : String(value)) + " " + units[unit];
}

function epochName(epoch) {
  return epoch === null ? "untagged" : String(epoch);
}

function showError(message) {
  const box = $("error");
  box.textContent = message;
  box.hidden = !message;
}

// ------------------------------------------------------------------ API (the bearer token stays in this tab)

class Unauthorized extends Error {}

async function api(path) {
  const headers = { Accept: "application/json" };
  const token = sessionStorage.getItem(TOKEN_KEY);
  if (token) headers.Authorization = "Bearer " + token;
  const response = await fetch(path, { headers, cache: "no-store", credentials: "omit" });
  if (response.status === 401) throw new Unauthorized("the server wants a bearer token");
  const body = await response.json().catch(() => null);
  if (!response.ok) {
    const message = body && body.error ? body.error.message : response.statusText;
    throw new Error(`${path}: HTTP ${response.status}: ${message}`);
  }
  return body;
}

function showLogin(message) {
  clearInterval(state.timer); // no polling behind the form; submitting it starts again
  state.timer = null;
  $("main").hidden = true;
  $("login").hidden = false;
  $("login-message").textContent = message || "";
  $("token").focus();
}

// ------------------------------------------------------------------ refresh

async function refresh() {
  try {
    const [health, stats, activity, nondeterministic] = await Promise.all([
      api("/healthz"), api("/v1/stats"), api("/v1/activity"), api("/v1/tools/nondeterministic"),
    ]);
    showError("");
    $("login").hidden = true;
    $("main").hidden = false;
    $("forget").hidden = !sessionStorage.getItem(TOKEN_KEY);
    const where = health.namespace === undefined ? "" : ` \u00b7 Ray namespace ${health.namespace}`;
    $("server").textContent = `server ${location.host} \u00b7 tvcache ${health.version}${where}`;
    $("since").textContent = "since " + new Date(activity.since * 1000).toLocaleString();
    state.activity = activity;
    const tasks = activity.tasks.map((task) => task.task_id);
    if (!tasks.includes(state.task)) state.task = tasks.length ? tasks[0] : null;
    renderCards(stats);
    renderShards(stats);
    renderTasks(activity);
    renderEpochs(activity);
    renderNondeterministic(nondeterministic);
    await refreshGraph();
  } catch (error) {
    if (error instanceof Unauthorized) {
      const had = sessionStorage.getItem(TOKEN_KEY);
      sessionStorage.removeItem(TOKEN_KEY);
      showLogin(had ? "That token was refused." : "");
    } else {
      showError(String(error.message || error));
    }
  }
}

function schedule() {
  clearInterval(state.timer);
  state.timer = $("auto").checked ? setInterval(refresh, REFRESH_MS) : null;
}

function selectTask(taskId) {
  if (taskId === state.task) return;
  state.task = taskId;
  state.selected = null;
  state.view = null;
  state.outlineKey = "";
  history.replaceState(null, "", "#task=" + encodeURIComponent(taskId));
  renderTasks(state.activity);
  renderEpochs(state.activity);
  refreshGraph().catch((error) => showError(String(error.message || error)));
}

// ------------------------------------------------------------------ totals and tables

function renderCards(stats) {
  const total = stats.hits + stats.misses;
  const cards = [
    ["hit-rate", "hit rate", total ? pct(stats.hits / total) : pct(null)],
    ["hits", "hits", stats.hits],
    ["misses", "misses", stats.misses],
    ["saved", "tool time saved", seconds(stats.seconds_saved)],
    ["executed", "tool time executed", seconds(stats.seconds_executed)],
    ["tasks", "tasks", stats.tasks],
    ["nodes", "nodes", stats.nodes],
    ["snapshots", "snapshots", `${stats.snapshots} (${bytes(stats.snapshot_bytes)})`],
  ];
  $("cards").replaceChildren(
    ...cards.map(([key, label, value]) =>
      el("div", { class: "card", "data-card": key }, el("div", { class: "value" }, value), el("div", { class: "label" }, label)),
    ),
  );
}

// The tools this server no longer serves from cache — in every task, or in the one task whose evidence showed
// it — with the evidence.
function renderNondeterministic(answer) {
  const marks = (answer.marks || []).slice().sort((a, b) => a.tool.localeCompare(b.tool));
  $("nondeterministic-section").hidden = marks.length === 0;
  const rows = marks.map((mark) =>
    el(
      "tr",
      { "data-tool": mark.tool },
      el("td", { class: "mono" }, mark.tool),
      el("td", mark.task_id === null ? {} : { class: "mono" }, mark.task_id === null ? "every task" : mark.task_id),
      el("td", {}, mark.reason),
    ),
  );
  $("nondeterministic").tBodies[0].replaceChildren(...rows);
}

// Only `tvcache ray dashboard` sends `shards` (its shard actors, each up or down with a message); a plain
// `tvcache serve` does not, and then there is no shard table and no warning.
function renderShards(stats) {
  const shards = Array.isArray(stats.shards) ? stats.shards : null;
  const down = shards ? shards.filter((shard) => !shard.up) : [];
  const warning = $("shard-warning");
  warning.textContent = down.length ? stats.message || `${down.length} of ${shards.length} shards down` : "";
  warning.hidden = !down.length;
  $("shards-section").hidden = !shards;
  const dash = "\u2013";
  const rows = (shards || []).map((shard) => {
    const own = shard.stats || {};
    const count = (key) => el("td", { class: "num", "data-field": key }, shard.up ? own[key] ?? dash : dash);
    const started = shard.started ? "started " + new Date(shard.started * 1000).toLocaleString() : "";
    return el(
      "tr",
      { class: shard.up ? "up" : "down", "data-shard": shard.name, "data-up": String(shard.up) },
      el("td", { class: "mono" }, shard.name),
      el("td", { class: shard.up ? "up" : "down", "data-field": "status" }, shard.up ? (shard.restarted ? "up (restarted)" : "up") : "down"),
      el("td", { "data-field": "node", title: shard.node_id ? "Ray node " + shard.node_id : "" }, shard.node_ip || (shard.node_id ? shard.node_id.slice(0, 12) : dash)),
      el("td", { class: "num" }, shard.pid ?? dash),
      count("tasks"),
      count("nodes"),
      count("hits"),
      count("misses"),
      el("td", { class: "message", "data-field": "message" }, shard.up ? started : shard.message || "down"),
    );
  });
  $("shards").tBodies[0].replaceChildren(...rows);
}

function renderTasks(activity) {
  // Rows from `tvcache ray dashboard` carry the shard that holds the task: show it in its own column.
  const sharded = activity.tasks.some((task) => task.shard !== undefined);
  document.querySelector("#tasks th[data-column=shard]").hidden = !sharded;
  const rows = activity.tasks.map((task) => {
    const shard = sharded
      ? [el("td", { class: "mono", "data-field": "shard", title: task.node_ip ? "on " + task.node_ip : "" }, task.shard ?? "\u2013")]
      : [];
    const row = el(
      "tr",
      { class: "task-row" + (task.task_id === state.task ? " selected" : ""), "data-task": task.task_id, title: task.task_id },
      el("td", { class: "task-id" }, task.task_id),
      ...shard,
      el("td", { class: "num" }, task.nodes),
      el("td", { class: "num" }, task.snapshots),
      el("td", { class: "num", "data-field": "hits" }, task.total.hits),
      el("td", { class: "num", "data-field": "misses" }, task.total.misses),
      el("td", { class: "num", "data-field": "hit-rate" }, pct(task.total.hit_rate)),
      el("td", { class: "num", "data-field": "saved" }, seconds(task.total.seconds_saved)),
      el("td", { class: "num" }, seconds(task.total.seconds_executed)),
      el("td", {}, sparkline(task.epochs)),
    );
    row.addEventListener("click", () => selectTask(task.task_id));
    return row;
  });
  $("tasks").tBodies[0].replaceChildren(...rows);
}

function sparkline(epochs) {
  const tagged = epochs.filter((e) => e.epoch !== null && e.hit_rate !== null);
  const width = 120, height = 22;
  const chart = svg("svg", { width, height, "aria-hidden": "true" });
  chart.append(svg("line", { x1: 0, y1: height - 2, x2: width, y2: height - 2, class: "grid" }));
  if (!tagged.length) return chart;
  const step = tagged.length > 1 ? (width - 8) / (tagged.length - 1) : 0;
  const points = tagged.map((e, i) => [4 + i * step, height - 2 - e.hit_rate * (height - 5)]);
  chart.append(svg("polyline", { points: points.map((p) => p.join(",")).join(" "), fill: "none", stroke: "#2563eb", "stroke-width": 1.5 }));
  for (const [x, y] of points) chart.append(svg("circle", { cx: x, cy: y, r: 1.8, fill: "#2563eb" }));
  return chart;
}

function allEpochs(activity) {
  const set = new Set();
  let untagged = false;
  for (const task of activity.tasks) for (const e of task.epochs) e.epoch === null ? (untagged = true) : set.add(e.epoch);
  const epochs = [...set].sort((a, b) => a - b);
  if (untagged) epochs.push(null);
  return epochs;
}

function rateColour(rate) {
  // white (0%) to green (100%)
  const mix = (a, b) => Math.round(a + (b - a) * rate);
  return `rgb(${mix(255, 134)},${mix(255, 214)},${mix(255, 160)})`;
}

function renderEpochs(activity) {
  const epochs = allEpochs(activity);
  const table = $("epochs");
  const head = el("tr", {}, el("th", {}, "task \\ epoch"), ...epochs.map((e) => el("th", { class: "num" }, epochName(e))));
  const rows = activity.tasks.map((task) => {
    const byEpoch = new Map(task.epochs.map((e) => [epochName(e.epoch), e]));
    const cells = epochs.map((epoch) => {
      const e = byEpoch.get(epochName(epoch));
      if (!e) return el("td", { class: "cell muted" }, "\u00b7");
      const cell = el(
        "td",
        { class: "cell", "data-task": task.task_id, "data-epoch": epochName(epoch), title: `saved ${seconds(e.seconds_saved)}` },
        el("span", { class: "rate" }, pct(e.hit_rate)),
        el("span", { class: "counts" }, `${e.hits} / ${e.hits + e.misses}`),
      );
      if (e.hit_rate !== null) cell.style.background = rateColour(e.hit_rate);
      return cell;
    });
    const row = el("tr", { class: "task-row" + (task.task_id === state.task ? " selected" : "") }, el("td", { class: "task-id" }, task.task_id), ...cells);
    row.addEventListener("click", () => selectTask(task.task_id));
    return row;
  });
  table.replaceChildren(el("thead", {}, head), el("tbody", {}, ...rows));
  for (const span of document.querySelectorAll(".task-name")) span.textContent = state.task === null ? "(no task yet)" : state.task;
  const task = activity.tasks.find((t) => t.task_id === state.task);
  renderRateChart(task, overallByEpoch(activity));
  renderSavedChart(task);
}

function overallByEpoch(activity) {
  const sums = new Map();
  for (const task of activity.tasks) {
    for (const e of task.epochs) {
      if (e.epoch === null) continue;
      const sum = sums.get(e.epoch) || { hits: 0, misses: 0 };
      sum.hits += e.hits;
      sum.misses += e.misses;
      sums.set(e.epoch, sum);
    }
  }
  return [...sums.entries()]
    .sort((a, b) => a[0] - b[0])
    .map(([epoch, s]) => ({ epoch, hit_rate: s.hits + s.misses ? s.hits / (s.hits + s.misses) : null }));
}

// ------------------------------------------------------------------ charts

const CHART = { width: 520, height: 220, left: 62, right: 34, top: 12, bottom: 34 };

function chartFrame(target, labels, yMax, yFormat, { bands = false } = {}) {
  const plotW = CHART.width - CHART.left - CHART.right;
  const plotH = CHART.height - CHART.top - CHART.bottom;
  // Points sit on the ends of the axis; bars (bands) in the middle of equal slots.
  const x = bands
    ? (i) => CHART.left + ((i + 0.5) * plotW) / labels.length
    : (i) => CHART.left + (labels.length > 1 ? (i * plotW) / (labels.length - 1) : plotW / 2);
  const y = (v) => CHART.top + plotH - (v / yMax) * plotH;
  const parts = [];
  for (let k = 0; k <= 4; k += 1) {
    const v = (yMax * k) / 4;
    parts.push(svg("line", { x1: CHART.left, x2: CHART.width - CHART.right, y1: y(v), y2: y(v), class: "grid" }));
    parts.push(svg("text", { x: CHART.left - 6, y: y(v) + 4, "text-anchor": "end", "font-size": 11, fill: "#616e7c" }, yFormat(v)));
  }
  const every = Math.max(1, Math.ceil(labels.length / 12));
  labels.forEach((label, i) => {
    if (i % every === 0 || i === labels.length - 1) {
      parts.push(svg("text", { x: x(i), y: CHART.height - CHART.bottom + 16, "text-anchor": "middle", "font-size": 11, fill: "#616e7c" }, label));
    }
  });
  parts.push(svg("text", { x: CHART.left + plotW / 2, y: CHART.height - 4, "text-anchor": "middle", "font-size": 11, fill: "#616e7c" }, "epoch"));
  parts.push(svg("line", { x1: CHART.left, x2: CHART.left, y1: CHART.top, y2: CHART.top + plotH, class: "axis" }));
  target.replaceChildren(...parts);
  return { x, y, plotW, plotH };
}

function emptyChart(target, message) {
  target.replaceChildren(svg("text", { x: CHART.width / 2, y: CHART.height / 2, "text-anchor": "middle", fill: "#616e7c", "font-size": 12 }, message));
}

function renderRateChart(task, overall) {
  const target = $("rate-chart");
  const tagged = task ? task.epochs.filter((e) => e.epoch !== null) : [];
  const epochs = [...new Set([...tagged.map((e) => e.epoch), ...overall.map((e) => e.epoch)])].sort((a, b) => a - b);
  if (!epochs.length) return emptyChart(target, "no epoch-tagged traffic yet");
  const { x, y } = chartFrame(target, epochs.map(String), 1, (v) => Math.round(v * 100) + "%");
  const line = (series, attrs) => {
    const points = series.filter((e) => e.hit_rate !== null).map((e) => [x(epochs.indexOf(e.epoch)), y(e.hit_rate)]);
    if (!points.length) return;
    target.append(svg("polyline", { points: points.map((p) => p.join(",")).join(" "), fill: "none", ...attrs }));
    for (const [px, py] of points) target.append(svg("circle", { cx: px, cy: py, r: 3, fill: attrs.stroke }));
  };
  line(overall, { stroke: "#9aa5b1", "stroke-width": 1.5, "stroke-dasharray": "5 4" });
  line(tagged, { stroke: "#2563eb", "stroke-width": 2.2 });
}

function renderSavedChart(task) {
  const target = $("saved-chart");
  const epochs = task ? task.epochs : [];
  if (!epochs.length) return emptyChart(target, "no traffic yet");
  const max = Math.max(...epochs.map((e) => e.seconds_saved), 1e-3);
  const { x, y, plotW } = chartFrame(target, epochs.map((e) => epochName(e.epoch)), max * 1.1, (v) => seconds(v), { bands: true });
  const bar = Math.min(36, (plotW / Math.max(epochs.length, 1)) * 0.6);
  epochs.forEach((e, i) => {
    const top = y(e.seconds_saved);
    target.append(
      svg("rect", { x: x(i) - bar / 2, y: top, width: bar, height: y(0) - top, fill: e.epoch === null ? "#9aa5b1" : "#15803d" },
        svg("title", {}, `epoch ${epochName(e.epoch)}: ${seconds(e.seconds_saved)} saved, ${e.hits} hits`)),
    );
  });
}

// ------------------------------------------------------------------ the tool call graph

async function refreshGraph() {
  if (state.task === null) {
    $("graph").replaceChildren();
    delete $("graph").dataset.task;
    $("graph-info").textContent = "No task has been cached yet.";
    return;
  }
  const task = state.activity.tasks.find((t) => t.task_id === state.task);
  if (!task || task.nodes === 0) {
    $("graph").replaceChildren();
    delete $("graph").dataset.task;
    $("graph-info").textContent = "This task has traffic but no cached calls.";
    return;
  }
  const outline = await api(`/v1/graph/outline?task_id=${encodeURIComponent(state.task)}&limit=${OUTLINE_LIMIT}`);
  if (outline.task_id !== state.task) return; // the selection moved on while we waited
  const key = outline.nodes.map((n) => `${n.id}:${n.hits}:${n.snapshot ? 1 : 0}`).join(",");
  state.outline = outline;
  const shown = outline.truncated ? `the first ${outline.nodes.length} of ${outline.total} nodes` : `${outline.total} nodes`;
  $("graph-info").textContent = `${shown} (the root included); node size and colour: hits.`;
  if (key === state.outlineKey) return;
  state.outlineKey = key;
  drawGraph(outline);
}

function layoutTree(nodes) {
  const byId = new Map(nodes.map((n) => [n.id, { ...n, children: [] }]));
  let root = null;
  for (const node of byId.values()) {
    const parent = node.parent === null ? null : byId.get(node.parent);
    if (parent) parent.children.push(node);
    else if (node.parent === null) root = node;
  }
  let slot = 0;
  // Iterative post-order: leaves take consecutive rows, a parent sits at the middle of its children.
  const stack = [[root, 0, false]];
  while (stack.length) {
    const [node, depth, visited] = stack.pop();
    node.depth = depth;
    if (!node.children.length) { node.row = slot; slot += 1; continue; }
    if (visited) { node.row = (node.children[0].row + node.children[node.children.length - 1].row) / 2; continue; }
    stack.push([node, depth, true]);
    for (let i = node.children.length - 1; i >= 0; i -= 1) stack.push([node.children[i], depth + 1, false]);
  }
  return { byId, root, rows: slot };
}

const DX = 215, DY = 34, PAD = 30;
const MIN_SCALE = 0.8; // below this, labels get hard to read: show part of the tree and let the user pan

function nodeRadius(hits) {
  return Math.min(22, 6 + 2.4 * Math.sqrt(hits));
}

const HEAT = [[255, 237, 160], [254, 178, 76], [240, 59, 32], [189, 0, 38]];

function heat(hits, maxHits) {
  if (hits === 0) return "#ffffff";
  const t = maxHits <= 1 ? 1 : Math.log(hits) / Math.log(maxHits);
  const pos = t * (HEAT.length - 1);
  const i = Math.min(HEAT.length - 2, Math.floor(pos));
  const f = pos - i;
  const c = HEAT[i].map((v, k) => Math.round(v + (HEAT[i + 1][k] - v) * f));
  return `rgb(${c.join(",")})`;
}

function shortLabel(node) {
  if (node.parent === null) return "root";
  const text = `${node.name}: ${node.label}`;
  return text.length > 28 ? text.slice(0, 27) + "\u2026" : text;
}

function drawGraph(outline) {
  const target = $("graph");
  const { byId } = layoutTree(outline.nodes);
  const maxHits = Math.max(1, ...outline.nodes.map((n) => n.hits));
  const edges = svg("g", {});
  const shapes = svg("g", {});
  let maxX = 0, maxY = 0;
  for (const node of byId.values()) {
    node.x = PAD + node.depth * DX;
    node.y = PAD + node.row * DY;
    maxX = Math.max(maxX, node.x);
    maxY = Math.max(maxY, node.y);
  }
  for (const node of byId.values()) {
    const parent = node.parent === null ? null : byId.get(node.parent);
    if (parent) {
      const mid = (parent.x + node.x) / 2;
      edges.append(svg("path", {
        d: `M${parent.x},${parent.y} C${mid},${parent.y} ${mid},${node.y} ${node.x},${node.y}`,
        class: "edge" + (node.read_only ? " read" : ""), "data-child": node.id,
      }));
    }
    const r = nodeRadius(node.hits);
    const kind = "node" + (node.snapshot ? " has-snapshot" : "") + (node.read_only ? " read-only" : "");
    const group = svg("g", { class: kind, "data-id": node.id, transform: `translate(${node.x},${node.y})` });
    group.append(svg("title", {}, `${node.parent === null ? "root" : node.name + " " + node.label}\n${node.hits} hits` +
      (node.snapshot ? ", snapshot" : "") + (node.is_error ? ", error result" : "")));
    if (node.snapshot) group.append(svg("circle", { r: r + 4.5, fill: "none", stroke: "#0d9488", "stroke-width": 2.5 }));
    const stroke = node.is_error ? "#b91c1c" : "#52606d";
    const fill = node.parent === null ? "#334e68" : heat(node.hits, maxHits);
    if (node.read_only) {
      group.append(svg("rect", { class: "shape", x: -r * 0.8, y: -r * 0.8, width: r * 1.6, height: r * 1.6, transform: "rotate(45)", fill, stroke, "stroke-width": node.is_error ? 2.5 : 1.3 }));
    } else {
      group.append(svg("circle", { class: "shape", r, fill, stroke, "stroke-width": node.is_error ? 2.5 : 1.3 }));
    }
    if (node.snapshot) group.append(svg("rect", { x: r * 0.55, y: -r - 6, width: 7, height: 7, fill: "#0d9488" }));
    const label = svg("text", { x: r + 7, y: 4 }, shortLabel(node));
    if (node.hits) label.append(svg("tspan", { class: "hits" }, ` \u00d7${node.hits}`));
    group.append(label);
    group.addEventListener("click", (event) => { event.stopPropagation(); selectNode(node.id); });
    shapes.append(group);
  }
  target.replaceChildren(edges, shapes);
  target.dataset.task = outline.task_id; // which task is drawn (the graphs of two tasks can look alike)
  state.bounds = { x: 0, y: 0, w: maxX + DX, h: maxY + PAD };
  state.rootY = byId.get(0) ? byId.get(0).y : 0;
  if (!state.view) fitView();
  applyView();
  renderLegend(maxHits);
  if (state.selected !== null && byId.has(state.selected)) highlight(state.selected);
  else state.selected = null;
}

function fitView() {
  // Fit the whole tree, but never zoom out so far that labels are unreadable: then start at the root's side.
  const target = $("graph");
  const b = state.bounds;
  const width = target.getBoundingClientRect().width || 1000;
  const scale = Math.max(MIN_SCALE, Math.min(1, width / b.w));
  const height = Math.round(Math.min(760, Math.max(360, b.h * scale)));
  target.style.height = height + "px";
  const w = width / scale, h = height / scale;
  const top = b.h > h ? Math.max(0, Math.min(b.h - h, state.rootY - h / 2)) : (b.h - h) / 2;
  state.view = { x: b.x, y: top, w, h };
}

function applyView() {
  const v = state.view;
  $("graph").setAttribute("viewBox", `${v.x} ${v.y} ${v.w} ${v.h}`);
}

function renderLegend(maxHits) {
  const swatch = (shape) => {
    const s = svg("svg", { width: 26, height: 22 });
    s.append(shape);
    return s;
  };
  const steps = [0, 1, Math.round(Math.sqrt(maxHits)), maxHits].filter((v, i, a) => a.indexOf(v) === i);
  const heatItems = steps.map((h) =>
    el("span", {}, swatch(svg("circle", { cx: 13, cy: 11, r: Math.min(10, nodeRadius(h) * 0.6), fill: heat(h, maxHits), stroke: "#52606d" })), ` ${h} hits`),
  );
  $("legend").replaceChildren(
    ...heatItems,
    el("span", {}, swatch(svg("circle", { cx: 13, cy: 11, r: 6, fill: "#fff", stroke: "#52606d" })), " state-changing call"),
    el("span", {}, swatch(svg("rect", { x: 8, y: 6, width: 10, height: 10, transform: "rotate(45 13 11)", fill: "#fff", stroke: "#52606d" })), " read-only call"),
    el("span", {}, swatch(svg("circle", { cx: 13, cy: 11, r: 8, fill: "none", stroke: "#0d9488", "stroke-width": 2.5 })), " snapshot"),
    el("span", {}, swatch(svg("circle", { cx: 13, cy: 11, r: 6, fill: "#fff", stroke: "#b91c1c", "stroke-width": 2.5 })), " error result"),
  );
}

function highlight(nodeId) {
  const nodes = new Map(state.outline.nodes.map((n) => [n.id, n]));
  const path = new Set();
  for (let id = nodeId; id !== null && nodes.has(id); id = nodes.get(id).parent) path.add(id);
  for (const g of document.querySelectorAll("#graph .node")) g.classList.toggle("selected", Number(g.dataset.id) === nodeId);
  for (const e of document.querySelectorAll("#graph .edge")) e.classList.toggle("on-path", path.has(Number(e.dataset.child)));
}

async function selectNode(nodeId) {
  state.selected = nodeId;
  highlight(nodeId);
  const task = state.task;
  try {
    const node = await api(`/v1/node?task_id=${encodeURIComponent(task)}&node_id=${nodeId}`);
    if (task === state.task && nodeId === state.selected) renderDetail(node);
  } catch (error) {
    showError(String(error.message || error));
  }
}

const MAX_OUTPUT = 100000;

function renderDetail(node) {
  const panel = $("detail");
  if (node.parent === null) {
    panel.replaceChildren(el("h3", {}, "root"), el("p", { class: "muted" }, "The task's initial state: no call."));
    return;
  }
  const nodes = new Map(state.outline.nodes.map((n) => [n.id, n]));
  const path = [];
  for (let id = node.parent; id !== null && nodes.has(id) && nodes.get(id).parent !== null; id = nodes.get(id).parent) {
    const n = nodes.get(id);
    if (!n.read_only) path.unshift(`${n.name}: ${n.label}`);
  }
  const output = node.output.length > MAX_OUTPUT ? node.output.slice(0, MAX_OUTPUT) + `\n\u2026 (${node.output.length - MAX_OUTPUT} more characters)` : node.output;
  const facts = [
    ["tool", node.name],
    ["node", String(node.id)],
    ["kind", node.read_only ? "read-only (keyed by the state it read)" : "state-changing"],
    ["hits", String(node.hits)],
    ["execution time", seconds(node.seconds)],
    ["time saved", seconds(node.hits * node.seconds)],
    ["result", node.is_error ? "error" : "ok"],
    ["snapshot", node.snapshot ? `${node.snapshot.kind}, ${bytes(node.snapshot.bytes)}` : "none"],
    ["digest", node.digest.slice(0, 16) + "\u2026"],
  ];
  panel.replaceChildren(
    el("h3", {}, `node ${node.id} \u00b7 ${node.name}`),
    el("dl", {}, ...facts.flatMap(([k, v]) => [el("dt", {}, k), el("dd", {}, v)])),
    el("div", { class: "muted" }, "call"),
    el("pre", { id: "detail-call" }, JSON.stringify({ name: node.name, arguments: node.arguments }, null, 2)),
    el("div", { class: "muted" }, node.is_error ? "result (error)" : "result"),
    el("pre", { id: "detail-output", class: node.is_error ? "error" : "" }, output),
    el("div", { class: "muted" }, path.length ? `executed in the state reached by (${path.length} calls)` : "executed in the initial state"),
    el("ol", {}, ...path.map((p) => el("li", {}, p))),
  );
}

// ------------------------------------------------------------------ pan and zoom

function installPanZoom() {
  const target = $("graph");
  let drag = null;
  target.addEventListener("pointerdown", (event) => {
    if (!state.view || event.target.closest(".node")) return;
    drag = { x: event.clientX, y: event.clientY, view: { ...state.view } };
    target.setPointerCapture(event.pointerId);
    target.classList.add("dragging");
  });
  target.addEventListener("pointermove", (event) => {
    if (!drag) return;
    const scale = state.view.w / target.getBoundingClientRect().width;
    state.view = { ...drag.view, x: drag.view.x - (event.clientX - drag.x) * scale, y: drag.view.y - (event.clientY - drag.y) * scale };
    applyView();
  });
  const end = () => { drag = null; target.classList.remove("dragging"); };
  target.addEventListener("pointerup", end);
  target.addEventListener("pointercancel", end);
  target.addEventListener("wheel", (event) => {
    if (!state.view) return;
    event.preventDefault();
    const box = target.getBoundingClientRect();
    const factor = Math.exp(Math.sign(event.deltaY) * 0.15);
    const v = state.view;
    const px = v.x + ((event.clientX - box.left) / box.width) * v.w;
    const py = v.y + ((event.clientY - box.top) / box.height) * v.h;
    state.view = { x: px - (px - v.x) * factor, y: py - (py - v.y) * factor, w: v.w * factor, h: v.h * factor };
    applyView();
  }, { passive: false });
}

// ------------------------------------------------------------------ start

function start() {
  const match = /^#task=(.*)$/.exec(location.hash);
  if (match) state.task = decodeURIComponent(match[1]);
  $("login").addEventListener("submit", (event) => {
    event.preventDefault();
    sessionStorage.setItem(TOKEN_KEY, $("token").value);
    $("token").value = "";
    schedule();
    refresh();
  });
  $("forget").addEventListener("click", () => {
    sessionStorage.removeItem(TOKEN_KEY);
    showLogin("Token forgotten.");
  });
  $("refresh").addEventListener("click", refresh);
  $("auto").addEventListener("change", schedule);
  $("fit").addEventListener("click", () => { if (state.bounds) { fitView(); applyView(); } });
  installPanZoom();
  schedule();
  refresh();
}

document.addEventListener("DOMContentLoaded", start);
