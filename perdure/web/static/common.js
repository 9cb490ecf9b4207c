/* perdure web: helpers shared by the pages. Every piece of run data enters the DOM as text (textContent or an
   attribute set through the DOM), never as markup. */
"use strict";

const PALETTE = ["#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#17becf", "#7f7f7f", "#bcbd22"];

/* el("td", {class: "num", title: t}, child, "text", ...): an element; strings become text nodes. */
function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(attrs || {})) {
    if (value === null || value === undefined || value === false) continue;
    if (key === "class") node.className = value;
    else if (key === "text") node.textContent = value;
    else if (key.startsWith("on")) node.addEventListener(key.slice(2), value);
    else node.setAttribute(key, value === true ? "" : String(value));
  }
  for (const child of children.flat()) {
    if (child === null || child === undefined) continue;
    node.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
  return node;
}

/* The API path of a run id ("group/run"): each part percent-encoded. */
function runPath(id) {
  return id.split("/").map(encodeURIComponent).join("/");
}

async function getJSON(url) {
  const response = await fetch(url, {headers: {Accept: "application/json"}});
  if (!response.ok) throw new Error(`${url}: HTTP ${response.status}`);
  return response.json();
}

function fmtNum(value) {
  if (value === null || value === undefined) return "–";
  if (typeof value !== "number") return String(value);
  if (Number.isInteger(value)) return String(value);
  const abs = Math.abs(value);
  if (abs !== 0 && (abs < 1e-3 || abs >= 1e5)) return value.toExponential(3);
  return value.toPrecision(5).replace(/\.?0+$/, "");
}

function fmtBytes(bytes) {
  if (bytes === null || bytes === undefined) return "–";
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let value = bytes, unit = 0;
  while (value >= 1024 && unit < units.length - 1) { value /= 1024; unit += 1; }
  return `${unit ? value.toFixed(1) : value} ${units[unit]}`;
}

/* An ISO time as "YYYY-MM-DD HH:MM" in local time; the exact ISO string in the title. */
function fmtTime(iso) {
  if (!iso) return el("span", {class: "muted"}, "–");
  const date = new Date(iso);
  if (Number.isNaN(date.getTime())) return el("span", {}, iso);
  const pad = (n) => String(n).padStart(2, "0");
  const text = `${date.getFullYear()}-${pad(date.getMonth() + 1)}-${pad(date.getDate())} ` +
    `${pad(date.getHours())}:${pad(date.getMinutes())}`;
  return el("span", {title: iso}, text);
}

function badge(status) {
  const known = ["running", "completed", "failed", "preempted", "stopped", "stale", "stuck", "hung"];
  return el("span", {class: "badge " + (known.includes(status) ? status : "")}, status || "unknown");
}

function tagList(tags) {
  return (tags || []).map((tag) => el("span", {class: "tag"}, tag));
}

function stepCell(row) {
  const step = row.step === null || row.step === undefined ? "–" : String(row.step);
  if (row.budget_unit === "epochs") return `${step} (epoch ${fmtNum(row.epoch)} / ${row.budget})`;
  return row.budget ? `${step} / ${row.budget}` : step;
}

function checkpointCell(row) {
  if (!row.checkpoint) return el("span", {class: "muted"}, "none");
  const checked = row.checkpoint_checked === "checksums" ? "checksums verified" : "sizes match (checksums pending)";
  const mark = row.checkpoint_verified
    ? el("span", {class: "ok", title: checked}, " \u2713")
    : el("span", {class: "bad", title: row.checkpoint_problem || "does not verify"}, " \u2717");
  return el("span", {class: "mono"}, row.checkpoint, mark);
}

/* Stable colours: a run keeps its colour while it stays selected. */
class ColorBook {
  constructor() { this.byId = new Map(); }
  color(id) {
    if (!this.byId.has(id)) {
      const used = new Set(this.byId.values());
      const free = PALETTE.find((c) => !used.has(c)) || PALETTE[this.byId.size % PALETTE.length];
      this.byId.set(id, free);
    }
    return this.byId.get(id);
  }
  keep(ids) {
    for (const id of [...this.byId.keys()]) if (!ids.includes(id)) this.byId.delete(id);
  }
}

function swatch(color) {
  const node = el("span", {class: "swatch"});
  node.style.background = color;
  return node;
}
