/* perdure web: the runs page. A table of every run (filter, sort, select), the selected runs' curves and images.
   The selection lives in the URL (#select=<id>,<id>) so a link or a reload shows the same comparison. */
"use strict";

const COLUMNS = [
  {key: "select", label: "", sort: null},
  {key: "lineage", label: "lineage"},
  {key: "id", label: "id"},
  {key: "status", label: "status"},
  {key: "attempts", label: "attempts", num: true},
  {key: "step", label: "step / budget", num: true},
  {key: "metric_latest", label: "metric: latest", num: true},
  {key: "metric_best", label: "best", num: true},
  {key: "checkpoint", label: "last checkpoint"},
  {key: "started", label: "started"},
  {key: "updated", label: "updated"},
  {key: "tags", label: "tags"},
];

const state = {
  runs: [],
  selected: [],
  sort: {key: "updated", desc: true},
  colors: new ColorBook(),
  metrics: new Map(),  // id -> {updated, data}
  media: new Map(),
};

const $ = (id) => document.getElementById(id);
const curves = new CurveBoard($("charts"));
const images = new MediaBoard($("media"));

function readSelection() {
  const match = /(?:^|&)select=([^&]*)/.exec(location.hash.slice(1));
  return match ? match[1].split(",").filter(Boolean).map(decodeURIComponent) : [];
}

function writeSelection() {
  const value = state.selected.map(encodeURIComponent).join(",");
  history.replaceState(null, "", value ? `#select=${value}` : location.pathname);
}

function sortValue(row, key) {
  if (key === "tags") return (row.tags || []).join(",");
  return row[key];
}

function compareRows(a, b) {
  const {key, desc} = state.sort;
  const x = sortValue(a, key), y = sortValue(b, key);
  if (x === y) return 0;
  if (x === null || x === undefined) return 1;  // empty cells last either way
  if (y === null || y === undefined) return -1;
  const order = typeof x === "number" && typeof y === "number" ? x - y : String(x).localeCompare(String(y));
  return desc ? -order : order;
}

function visibleRuns() {
  const text = $("filter-text").value.trim().toLowerCase();
  const status = $("filter-status").value;
  const tag = $("filter-tag").value;
  return state.runs.filter((row) => {
    if (status && row.status !== status) return false;
    if (tag && !(row.tags || []).includes(tag)) return false;
    if (!text) return true;
    const haystack = [row.id, row.lineage, row.status, row.metric, ...(row.tags || [])].join(" ").toLowerCase();
    return haystack.includes(text);
  }).sort(compareRows);
}

function fillSelect(select, values) {
  const current = select.value;
  const first = select.options[0];
  select.replaceChildren(first, ...values.map((value) => el("option", {value}, value)));
  select.value = values.includes(current) ? current : "";
}

function renderHead() {
  const row = el("tr", {}, COLUMNS.map((column) => {
    if (column.sort === null) return el("th", {});
    const sorted = state.sort.key === column.key ? (state.sort.desc ? "sorted-desc" : "sorted-asc") : "";
    const classes = [sorted, column.num ? "num" : ""].join(" ").trim() || null;
    return el("th", {"data-key": column.key, class: classes, title: "sort", onclick: () => {
      state.sort = {key: column.key, desc: state.sort.key === column.key ? !state.sort.desc : false};
      renderHead();
      renderTable();
    }}, column.label);
  }));
  $("runs").tHead.replaceChildren(row);
}

function renderTable() {
  const rows = visibleRuns();
  $("count").textContent = `${rows.length} of ${state.runs.length} run(s)`;
  const body = rows.map((row) => {
    const selected = state.selected.includes(row.id);
    const box = el("input", {type: "checkbox", class: "select", "aria-label": `select ${row.id}`, checked: selected,
      onchange: (event) => toggle(row.id, event.target.checked)});
    const color = selected ? swatch(state.colors.color(row.id)) : null;
    return el("tr", {class: selected ? "selected" : null, "data-id": row.id},
      el("td", {}, box),
      el("td", {}, row.lineage || "–"),
      el("td", {class: "id", title: row.id}, color, el("a", {href: row.url}, row.id.split("/").pop()),
        el("span", {class: "group"}, row.id.split("/")[0])),
      el("td", {}, badge(row.status)),
      el("td", {class: "num"}, fmtNum(row.attempts)),
      el("td", {class: "num"}, stepCell(row)),
      el("td", {class: "num"}, fmtNum(row.metric_latest), el("span", {class: "metric-name"}, row.metric)),
      el("td", {class: "num", title: row.metric_best_step !== null ? `at step ${row.metric_best_step}` : null},
        fmtNum(row.metric_best), row.metric_mode ? el("span", {class: "muted"}, ` ${row.metric_mode}`) : null),
      el("td", {class: "nowrap"}, checkpointCell(row)),
      el("td", {class: "nowrap"}, fmtTime(row.started)),
      el("td", {class: "nowrap"}, fmtTime(row.updated)),
      el("td", {class: "tags"}, tagList(row.tags)));
  });
  if (!body.length) {
    body.push(el("tr", {}, el("td", {colspan: COLUMNS.length, class: "empty"},
      state.runs.length ? "No run matches the filters." : "No runs under this workspace root yet.")));
  }
  $("runs").tBodies[0].replaceChildren(...body);
}

function toggle(id, on) {
  state.selected = on ? [...state.selected.filter((x) => x !== id), id] : state.selected.filter((x) => x !== id);
  state.colors.keep(state.selected);
  writeSelection();
  renderTable();
  refreshSelected().catch(showError);
}

async function loadRuns(rescan) {
  const data = await getJSON(rescan ? "/api/runs?rescan=full" : "/api/runs");
  state.runs = data.runs;
  $("root").textContent = data.root;
  const known = new Set(state.runs.map((row) => row.id));
  state.selected = state.selected.filter((id) => known.has(id));
  fillSelect($("filter-status"), [...new Set(state.runs.map((row) => row.status))].sort());
  fillSelect($("filter-tag"), [...new Set(state.runs.flatMap((row) => row.tags || []))].sort());
  renderTable();
}

/* Fetch metrics and media of the selected runs: each run the first time, then again while it runs or when its
   sidecar moved on. */
async function refreshSelected() {
  const rows = new Map(state.runs.map((row) => [row.id, row]));
  state.selected = state.selected.filter((id) => rows.has(id));
  await Promise.all(state.selected.map(async (id) => {
    const row = rows.get(id);
    const cached = state.metrics.get(id);
    if (cached && cached.updated === row.updated && row.status !== "running") return;
    const [metrics, media] = await Promise.all([
      getJSON(`/api/runs/${runPath(id)}/metrics`), getJSON(`/api/runs/${runPath(id)}/media`)]);
    state.metrics.set(id, {updated: row.updated, data: metrics.metrics});
    state.media.set(id, media.media);
  }));
  const chosen = state.selected.filter((id) => state.metrics.has(id));
  curves.setRuns(chosen.map((id) => ({id, color: state.colors.color(id), metrics: state.metrics.get(id).data})));
  images.setRuns(chosen.map((id) => ({id, color: state.colors.color(id), media: state.media.get(id) || []})));
}

async function refresh(rescan) {
  try {
    await loadRuns(rescan);
    await refreshSelected();
    $("message").textContent = "";
  } catch (error) {
    showError(error);
  }
}

function showError(error) {
  $("message").textContent = `cannot reach the server: ${error.message}`;
}

$("filter-text").addEventListener("input", renderTable);
$("filter-status").addEventListener("change", renderTable);
$("filter-tag").addEventListener("change", renderTable);
$("rescan").addEventListener("click", () => refresh(true));
window.addEventListener("hashchange", () => {
  state.selected = readSelection();
  renderTable();
  refreshSelected().catch(showError);
});
setInterval(() => { if ($("live").checked) refresh(false); }, 5000);

state.selected = readSelection();
renderHead();
refresh(false);
