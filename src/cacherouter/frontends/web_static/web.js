// The cacherouter web UI: plain JavaScript, no dependencies. Everything from the server is rendered as text
// (textContent), never as HTML: tool results are arbitrary bytes from scripts.
"use strict";

const $ = (id) => document.getElementById(id);
// While a turn runs (this tab's or another's), the state is fetched again every second to show its progress.
let refresh = null;
// Bumped by each chat reply: a state fetched before the reply arrived is older than the reply's, and is dropped.
let generation = 0;

function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(attrs || {})) {
    if (key === "class") node.className = value;
    else node.setAttribute(key, value);
  }
  for (const child of children) node.append(child instanceof Node ? child : document.createTextNode(String(child)));
  return node;
}

const tokens = (value) => (value === null || value === undefined ? "" : String(value));
const cost = (value) => (value === null || value === undefined ? "unknown" : value.toFixed(1));
const pct = (num, den) => (num === null || num === undefined || !den ? "" : ((100 * num) / den).toFixed(1) + "%");

function showError(message) {
  $("error").textContent = message;
  $("error").hidden = !message;
}

function renderCall(call) {
  const classes = ["call"];
  if (call.router) classes.push("router");
  if (call.ok === false) classes.push("failed");
  const head = el("div", {}, el("span", { class: "call-name" }, call.name));
  if (call.router) head.append(" \u2192 ", el("span", { class: "call-routed" }, call.routed_to || "no tool"));
  // ok is null for the calls of a turn that failed midway: they ran, their outcome is in the result.
  const status = call.ok === false ? "failed" : call.ok === null ? "ran" : "ok";
  head.append(" ", el("span", { class: "meta call-status" }, status));
  const args = typeof call.arguments === "string" ? call.arguments : JSON.stringify(call.arguments);
  return el(
    "div",
    { class: classes.join(" "), "data-call": call.id },
    head,
    el("pre", { class: "call-args" }, args),
    el("pre", { class: "call-result" }, call.result),
  );
}

function renderTurn(turn) {
  const item = el("li", { "data-turn": turn.index });
  item.append(el("div", { class: "msg user" }, el("span", { class: "who" }, "you"), el("span", { class: "text" }, turn.query)));
  for (const call of turn.calls) item.append(renderCall(call));
  if (turn.pending) {
    const progress = "working\u2026 " + turn.requests.length + " model request(s) so far";
    item.append(el("div", { class: "msg pending" }, el("span", { class: "who" }, "agent"), el("span", { class: "text" }, progress)));
  } else if (turn.error !== null) {
    item.append(el("div", { class: "msg error" }, el("span", { class: "who" }, "error"), el("span", { class: "text" }, turn.error)));
  } else {
    item.append(el("div", { class: "msg agent" }, el("span", { class: "who" }, "agent"), el("span", { class: "text" }, turn.answer)));
    const notes = [turn.path + " path", turn.calls.length + " call(s)", turn.requests.length + " model request(s)"];
    if (turn.deep_thinking.length) notes.push("deep thinking: " + turn.deep_thinking.join("; "));
    item.append(el("div", { class: "meta" }, notes.join(" \u00b7 ")));
  }
  return item;
}

function render(state) {
  $("mode").textContent = state.label;
  $("mode").className = state.mode === "live" ? "badge live" : "badge";
  $("cache-label").textContent = state.label;
  $("cache-label").className = $("mode").className;
  $("cache-source").textContent = state.mode === "live"
    ? "provider-reported (read from each response's usage fields)"
    : "SCRIPTED (computed by the offline DeepSeek prefix-cache model, no network)";
  $("banner").textContent = state.banner;
  $("session").textContent = state.session;
  $("view").textContent = state.main_view.join(", ");
  $("transcript").replaceChildren(...state.turns.map(renderTurn));
  const rows = [];
  for (const turn of state.turns) {
    for (const r of turn.requests) {
      rows.push(el("tr", { "data-request": r.index },
        el("td", { "data-field": "index" }, r.index),
        el("td", { "data-field": "turn" }, r.turn + 1),
        el("td", { "data-field": "channel" }, r.channel),
        el("td", { "data-field": "prompt" }, tokens(r.prompt_tokens)),
        el("td", { "data-field": "cached" }, tokens(r.cached_tokens)),
        el("td", { "data-field": "hit" }, pct(r.cached_tokens, r.prompt_tokens)),
        el("td", { "data-field": "cost" }, cost(r.cost)),
      ));
    }
  }
  $("requests").tBodies[0].replaceChildren(...rows);
  const totals = state.totals;
  $("totals").querySelector("[data-field=prompt]").textContent = totals.prompt_tokens;
  $("totals").querySelector("[data-field=cached]").textContent = totals.cached_tokens;
  $("totals").querySelector("[data-field=hit]").textContent =
    totals.hit_rate === null ? "" : (100 * totals.hit_rate).toFixed(1) + "%";
  const unknown = totals.unknown_cost_requests;
  $("totals").querySelector("[data-field=cost]").textContent =
    cost(totals.cost) + (unknown && totals.cost !== null ? " (+" + unknown + " unknown)" : "");
  $("message").maxLength = state.max_message_chars;
  document.body.dataset.turns = String(state.turns.filter((turn) => !turn.pending).length);
  scheduleRefresh(state.turns.some((turn) => turn.pending));
}

function scheduleRefresh(running) {
  clearTimeout(refresh);
  refresh = running || document.body.dataset.busy ? setTimeout(() => load().catch(() => {}), 1000) : null;
}

async function load() {
  const started = generation;
  const response = await fetch("/api/state", { cache: "no-store" });
  if (!response.ok) throw new Error("GET /api/state: HTTP " + response.status);
  const state = await response.json();
  if (started === generation) render(state);
}

async function send(event) {
  event.preventDefault();
  const input = $("message");
  const message = input.value.trim();
  if (!message) return;
  $("send").disabled = true;
  document.body.dataset.busy = "1";
  scheduleRefresh(true);
  try {
    const response = await fetch("/api/chat", {
      method: "POST",
      headers: { "Content-Type": "application/json" },
      body: JSON.stringify({ message }),
    });
    const body = await response.json();
    if (!response.ok) throw new Error(body.error || "HTTP " + response.status);
    input.value = "";
    showError("");
    generation += 1;
    render(body.state);
  } catch (error) {
    showError(String(error.message || error));
  } finally {
    $("send").disabled = false;
    delete document.body.dataset.busy;
    input.focus();
  }
}

document.addEventListener("DOMContentLoaded", () => {
  $("ask").addEventListener("submit", send);
  load().catch((error) => showError(String(error.message || error)));
});
