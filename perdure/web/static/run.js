/* perdure web: one run's page. Its facts, curves and images; checkpoints with their manifests and verification;
   the goodput (where the run's time went); attempts with their exit reasons and steps lost; config (diff against
   the defaults, and in full); git state; the tail of its log. While the run is running the page refreshes itself. */
"use strict";

const $ = (id) => document.getElementById(id);
const RUN_ID = location.pathname.split("/").slice(2).map(decodeURIComponent).join("/");
const API = `/api/runs/${runPath(RUN_ID)}`;
const COLOR = PALETTE[0];
const curves = new CurveBoard($("charts"));
const images = new MediaBoard($("media"));
let status = null;
let pending = false;  // some checkpoint is verified by sizes only, its checksums are still being compared

function table(headers, rows, numeric) {
  const numbers = new Set(numeric || []);
  return el("div", {class: "scroll"}, el("table", {class: "data"},
    el("thead", {}, el("tr", {}, headers.map((header) => el("th", {}, header)))),
    el("tbody", {}, rows.map((cells) => el("tr", {}, cells.map((cell, i) =>
      el("td", {class: numbers.has(i) ? "num" : null}, cell)))))));
}

function facts(pairs) {
  return el("dl", {class: "facts"}, pairs.flatMap(([key, value]) => [el("dt", {}, key), el("dd", {}, value)]));
}

function plain(value) {
  if (value === null || value === undefined) return "null";
  if (typeof value === "object") return JSON.stringify(value);
  return String(value);
}

function flatten(value, prefix, out) {
  if (value && typeof value === "object" && !Array.isArray(value) && Object.keys(value).length) {
    for (const [key, item] of Object.entries(value)) flatten(item, prefix ? `${prefix}.${key}` : key, out);
  } else if (prefix) {
    out.push([prefix, value]);
  }
  return out;
}

function empty(text) {
  return el("p", {class: "empty"}, text);
}

function renderSummary(run) {
  document.title = `${run.id} · perdure`;
  $("title").replaceChildren(run.id, " ", badge(run.status));
  const best = run.metric_best === null ? "–"
    : `${fmtNum(run.metric_best)} (${run.metric_mode}, step ${fmtNum(run.metric_best_step)})`;
  $("summary").replaceChildren(facts([
    ["lineage", run.lineage || "–"],
    ["run id", el("span", {class: "mono"}, run.run_id)],
    ["code / config", el("span", {class: "mono"}, `${run.code_id || "–"} / ${run.config_id}`)],
    ["step / budget", stepCell(run)],
    ["attempts", fmtNum(run.attempts)],
    ["goodput", run.goodput ? `${(100 * run.goodput.fraction).toFixed(1)}%` : "–"],
    [`${run.metric} latest`, fmtNum(run.metric_latest)],
    [`${run.metric} best`, best],
    ["last checkpoint", checkpointCell(run)],
    ["best checkpoint", el("span", {class: "mono"}, run.best_checkpoint || "–")],
    ["started", fmtTime(run.started)],
    ["updated", fmtTime(run.updated)],
    ["tags", run.tags.length ? tagList(run.tags) : "–"],
  ]));
}

/* The manifest's other facts (backend, world size, score, ...) as "key value" pairs. */
function manifestFacts(manifest) {
  const shown = new Set(["name", "global_step", "epoch", "reason", "created", "config_id", "code_id"]);
  return Object.entries(manifest || {}).filter(([key]) => !shown.has(key))
    .map(([key, value]) => `${key} ${typeof value === "number" ? fmtNum(value) : plain(value)}`).join(" \u00b7 ");
}

function renderCheckpoints(info) {
  const parts = [];
  if (info.checkpoints.length) {
    parts.push(table(["name", "step", "epoch", "saved because", "created", "files", "size", "verified", "manifest", ""],
      info.checkpoints.map((c) => [
        el("span", {class: "mono"}, c.name),
        fmtNum(c.step), fmtNum(c.epoch), c.reason || "–", c.created || "–", fmtNum(c.files), fmtBytes(c.size),
        c.verified ? el("span", {class: "ok"}, `\u2713 ${c.checked}`) : el("span", {class: "bad"}, `\u2717 ${c.problem}`),
        el("span", {class: "muted"}, manifestFacts(c.manifest)),
        [c.latest ? el("span", {class: "tag"}, "latest") : null, c.best ? el("span", {class: "tag"}, "best") : null],
      ]), [1, 2, 5, 6]));
  } else {
    parts.push(empty("No committed checkpoint."));
  }
  if (info.quarantined.length) {
    parts.push(el("h3", {}, "Quarantined"), table(["name", "when", "why"],
      info.quarantined.map((q) => [el("span", {class: "mono"}, q.name), q.quarantined || "–", q.reason || "–"])));
  }
  if (info.in_flight.length) {
    parts.push(el("h3", {}, "Being written (or interrupted)"), el("p", {class: "mono"}, info.in_flight.join(", ")));
  }
  $("checkpoint-list").replaceChildren(...parts);
}

/* Where the run's wall time went: the fraction that trained the model, then seconds per part, the run's and each
   attempt's (docs/workspace.md, "Goodput"). */
function renderGoodput(run) {
  const goodput = run.goodput;
  if (!goodput) {
    $("goodput-list").replaceChildren(empty("No goodput recorded (a run from before perdure measured it)."));
    return;
  }
  const percent = (part, whole) => whole > 0 ? `${(100 * part / whole).toFixed(1)}%` : "–";
  const wall = Object.values(goodput.seconds).reduce((a, b) => a + b, 0);
  const seconds = (value) => typeof value === "number" ? value.toFixed(2) : "–";
  const rows = Object.entries(goodput.seconds).map(([part, value]) => [
    part, seconds(value), percent(value, wall),
    ...run.attempt_list.map((a) => seconds(a.goodput ? a.goodput.seconds[part] : null)),
  ]);
  rows.push(["wall", seconds(wall), "100.0%", ...run.attempt_list.map((a) =>
    seconds(a.goodput ? Object.values(a.goodput.seconds).reduce((x, y) => x + y, 0) : null))]);
  $("goodput-list").replaceChildren(
    el("p", {}, `goodput ${percent(goodput.fraction, 1)} of the run's wall time trained the model (kept training)`),
    table(["part", "run s", "share", ...run.attempt_list.map((a) => `#${a.number} s`)], rows,
      rows[0].map((_, i) => i).slice(1)));
}

function renderAttempts(run) {
  if (!run.attempt_list.length) {
    $("attempt-list").replaceChildren(empty(run.attempts_problem || "No attempt recorded."));
    return;
  }
  $("attempt-list").replaceChildren(table(
    ["#", "started", "ended", "status", "resumed from", "steps done", "steps lost", "restarts", "exit reason"],
    run.attempt_list.map((a) => [
      String(a.number), fmtTime(a.started), fmtTime(a.ended), badge(a.status),
      a.resumed_from ? `${a.resumed_from} (step ${fmtNum(a.resumed_step)})` : `step ${fmtNum(a.resumed_step)}`,
      fmtNum(a.steps_done), fmtNum(a.steps_lost),
      Object.entries(a.restart_counts).map(([k, v]) => `${k}=${plain(v)}`).join(", ") || "–",
      [a.exit_reason || "–", ...a.save_failures.map((f) => el("div", {class: "bad"}, `save ${f.checkpoint} failed: ${f.error}`))],
    ]), [0, 5, 6]));
}

function renderConfig(config) {
  const parts = [];
  const diff = config.diff;
  if (diff && typeof diff === "object") {
    const rows = [];
    for (const [key, entry] of Object.entries(diff.changed || {})) rows.push([key, plain(entry.default), plain(entry.value)]);
    for (const [key, entry] of Object.entries(diff.added || {})) rows.push([key, "(not in defaults)", plain(entry.value)]);
    for (const [key, entry] of Object.entries(diff.removed || {})) rows.push([key, plain(entry.default), "(removed)"]);
    parts.push(el("h3", {}, "Changed from the defaults", el("span", {class: "muted"}, ` of ${plain(diff.defaults)}`)));
    parts.push(rows.length ? table(["key", "default", "value"], rows.map((r) => r.map((c, i) =>
      el("span", {class: i ? "mono" : "mono"}, c)))) : empty("Nothing: every key has its default value."));
  }
  if (config.full && typeof config.full === "object") {
    const rows = flatten(config.full, "", []).map(([key, value]) => [el("span", {class: "mono"}, key),
      el("span", {class: "mono"}, plain(value))]);
    parts.push(el("details", {}, el("summary", {}, `Full config (${rows.length} keys)`), table(["key", "value"], rows)));
  }
  if (config.attempt) parts.push(el("p", {class: "muted"}, `as recorded by attempt ${config.attempt}`));
  for (const problem of config.problems || []) parts.push(el("p", {class: "error"}, problem));
  $("config-body").replaceChildren(...(parts.length ? parts : [empty("No config recorded.")]));
}

function renderGit(config) {
  const git = config.git;
  const parts = [];
  if (git && typeof git === "object") {
    parts.push(facts(["commit", "code_id", "branch", "dirty", "remote", "root"].map((key) =>
      [key, el("span", {class: "mono"}, plain(git[key]))])));
  } else {
    parts.push(empty("Not run from a git checkout."));
  }
  if (config.git_diff) {
    const note = config.git_diff_truncated ? " (first 256 KiB)" : "";
    parts.push(el("details", {}, el("summary", {}, `Uncommitted changes (git diff)${note}`),
      el("pre", {class: "diff"}, config.git_diff)));
  } else if (git) {
    parts.push(el("p", {class: "muted"}, "Clean tree: no uncommitted changes."));
  }
  $("git-body").replaceChildren(...parts);
}

function renderLogChoices(logs) {
  const select = $("log-file");
  const current = select.value;
  select.replaceChildren(...logs.map((log) => el("option", {value: log.name}, `${log.name} (${fmtBytes(log.size)})`)));
  const names = logs.map((log) => log.name);
  select.value = names.includes(current) ? current : names[names.length - 1] || "";
}

async function loadLog() {
  const name = $("log-file").value;
  if (!name) {
    $("log-text").textContent = "";
    $("log-note").textContent = "no log file";
    return;
  }
  const log = await getJSON(`${API}/log?name=${encodeURIComponent(name)}&kib=64`);
  const pre = $("log-text");
  const atBottom = pre.scrollTop + pre.clientHeight >= pre.scrollHeight - 4;
  pre.textContent = log.text;
  if (atBottom) pre.scrollTop = pre.scrollHeight;
  $("log-note").textContent = log.truncated ? `last 64 KiB of ${fmtBytes(log.size)}` : fmtBytes(log.size);
}

async function load() {
  const [run, metrics, media] = await Promise.all([getJSON(API), getJSON(`${API}/metrics`), getJSON(`${API}/media`)]);
  status = run.status;
  pending = run.checkpoints.checkpoints.some((c) => c.verified && c.checked !== "checksums");
  renderSummary(run);
  curves.setRuns([{id: run.id, color: COLOR, metrics: metrics.metrics}]);
  images.setRuns([{id: run.id, color: COLOR, media: media.media}]);
  renderCheckpoints(run.checkpoints);
  renderGoodput(run);
  renderAttempts(run);
  renderConfig(run.config);
  renderGit(run.config);
  renderLogChoices(run.logs);
  await loadLog();
  $("message").textContent = "";
}

function showError(error) {
  $("message").textContent = `cannot load this run: ${error.message}`;
}

$("log-file").addEventListener("change", () => loadLog().catch(showError));
/* Refresh while the run trains, and until every checkpoint's checksums have been verified (in the background). */
setInterval(() => { if ($("live").checked && (status === "running" || pending)) load().catch(showError); }, 3000);
load().catch(showError);
