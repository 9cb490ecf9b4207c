/* perdure web: one uPlot chart per metric, the selected runs overlaid, with smoothing, a log scale and a choice of
   x axis (step, or training time rebuilt from steps/s). Charts are kept in window.perdureCharts (metric -> uPlot)
   so that tests and scripts can read what is drawn. */
"use strict";

window.perdureCharts = {};

/* train/loss first, then validation metrics, then other metrics, then learning rate and speed. */
function metricOrder(key) {
  if (key === "train/loss") return [0, key];
  if (key.startsWith("val/")) return [1, key];
  if (key === "train/lr") return [3, key];
  if (key === "train/steps_per_s") return [4, key];
  return [2, key];
}

function compareMetrics(a, b) {
  const [ra, ka] = metricOrder(a), [rb, kb] = metricOrder(b);
  return ra - rb || (ka < kb ? -1 : ka > kb ? 1 : 0);
}

/* TensorBoard's smoothing: an exponential moving average, debiased at the start. */
function smooth(values, weight) {
  if (!weight) return values;
  let last = 0, count = 0;
  return values.map((value) => {
    if (value === null || value === undefined) return null;
    last = last * weight + (1 - weight) * value;
    count += 1;
    return last / (1 - Math.pow(weight, count));
  });
}

/* Steps are whole numbers: tick spacings 1, 2, 5, 10, 20, 25, 50, ... */
const STEP_INCREMENTS = [];
for (let scale = 1; scale <= 1e12; scale *= 10) STEP_INCREMENTS.push(scale, 2 * scale, 2.5 * scale, 5 * scale);
STEP_INCREMENTS.splice(STEP_INCREMENTS.indexOf(2.5), 1);

/* An axis tick: at most 4 significant digits, no trailing zeros; exponent form for very small or large values. */
function tick(value) {
  if (value === null || value === undefined) return "";
  const abs = Math.abs(value);
  if (abs !== 0 && (abs < 1e-3 || abs >= 1e6)) return value.toExponential(1);
  return String(Number(value.toPrecision(4)));
}

class CurveBoard {
  /* Builds its controls (x axis, smoothing, log scale) and a grid of charts inside `host`. */
  constructor(host) {
    const option = (value, text) => el("option", {value}, text);
    this.controls = {
      xAxis: el("select", {"aria-label": "x axis"}, option("step", "step"), option("time", "training time (s)")),
      smoothing: el("input", {type: "range", min: 0, max: 0.99, step: 0.01, value: 0, "aria-label": "smoothing"}),
      smoothingValue: el("span", {class: "mono"}, "0.00"),
      logScale: el("input", {type: "checkbox", "aria-label": "log scale"}),
    };
    const c = this.controls;
    this.container = el("div", {class: "charts"});
    host.replaceChildren(
      el("div", {class: "controls"},
        el("label", {}, "x axis ", c.xAxis),
        el("label", {title: "exponential moving average, as TensorBoard smooths"}, "smoothing ", c.smoothing),
        c.smoothingValue,
        el("label", {}, c.logScale, " log scale")),
      this.container);
    this.runs = [];
    this.charts = new Map();  // metric -> {plot, box, signature}
    const rerender = () => this.render(true);
    c.xAxis.addEventListener("change", rerender);
    c.logScale.addEventListener("change", rerender);
    c.smoothing.addEventListener("input", () => {
      c.smoothingValue.textContent = Number(c.smoothing.value).toFixed(2);
      this.render(false);
    });
    window.addEventListener("resize", () => this.resize());
  }

  /* runs: [{id, color, metrics: {"split/name": {step, value, time}}}] */
  setRuns(runs) {
    this.runs = runs;
    this.render(false);
  }

  settings() {
    return {
      x: this.controls.xAxis.value,
      log: this.controls.logScale.checked,
      weight: Number(this.controls.smoothing.value),
    };
  }

  render(rebuild) {
    const settings = this.settings();
    const keys = new Set();
    for (const run of this.runs) for (const key of Object.keys(run.metrics || {})) keys.add(key);
    const metrics = [...keys].sort(compareMetrics);
    for (const [metric, chart] of this.charts) {
      if (!keys.has(metric) || rebuild) {
        chart.plot.destroy();
        chart.box.remove();
        this.charts.delete(metric);
        delete window.perdureCharts[metric];
      }
    }
    if (!metrics.length) {
      this.container.replaceChildren(el("p", {class: "empty"}, this.runs.length
        ? "No metrics logged yet." : "Select runs in the table to compare their curves."));
      return;
    }
    for (const node of [...this.container.children]) if (!node.classList.contains("chart")) node.remove();
    metrics.forEach((metric, position) => {
      const data = this.align(metric, settings);
      const signature = JSON.stringify([data.ids, data.colors, settings.x, settings.log]);
      let chart = this.charts.get(metric);
      if (chart && chart.signature !== signature) {
        chart.plot.destroy();
        chart.box.remove();
        chart = null;
      }
      if (!chart) {
        chart = this.create(metric, data, settings);
        chart.signature = signature;
        this.charts.set(metric, chart);
        window.perdureCharts[metric] = chart.plot;
      } else {
        chart.plot.setData(data.columns);
      }
      if (this.container.children[position] !== chart.box) {
        this.container.insertBefore(chart.box, this.container.children[position] || null);
      }
    });
  }

  /* The uPlot columns of one metric: x = every x value of any run, one y column per run (null where absent). */
  align(metric, settings) {
    const series = [];
    for (const run of this.runs) {
      const entry = (run.metrics || {})[metric];
      if (!entry) continue;
      const xs = settings.x === "time" ? entry.time : entry.step;
      if (!xs) continue;
      let ys = smooth(entry.value, settings.weight);
      if (settings.log) ys = ys.map((y) => (y !== null && y > 0 ? y : null));
      series.push({id: run.id, color: run.color, xs, ys});
    }
    const xs = [...new Set(series.flatMap((s) => s.xs))].sort((a, b) => a - b);
    const where = new Map(xs.map((x, i) => [x, i]));
    const columns = [xs];
    for (const s of series) {
      const column = new Array(xs.length).fill(null);
      s.xs.forEach((x, i) => { column[where.get(x)] = s.ys[i]; });
      columns.push(column);
    }
    return {columns, ids: series.map((s) => s.id), colors: series.map((s) => s.color)};
  }

  width() {
    const columns = getComputedStyle(this.container).gridTemplateColumns.split(" ").length || 1;
    const total = this.container.clientWidth || 900;
    return Math.max(320, Math.floor((total - 14 * (columns - 1)) / columns) - 18);
  }

  create(metric, data, settings) {
    const box = el("div", {class: "chart", "data-metric": metric}, el("h3", {}, metric));
    this.container.append(box);
    const xLabel = settings.x === "time" ? "training time (s)" : "step";
    const options = {
      width: this.width(),
      height: 240,
      scales: {x: {time: false}, y: settings.log ? {distr: 3} : {}},
      axes: [
        {label: xLabel, labelSize: 18, size: 34, incrs: settings.x === "step" ? STEP_INCREMENTS : undefined},
        {size: 64, values: (u, splits) => splits.map(tick)},
      ],
      cursor: {drag: {x: true, y: false}},
      legend: {live: true},
      series: [
        {label: xLabel},
        ...data.ids.map((id, i) => ({
          label: id,
          stroke: data.colors[i],
          width: 1.6,
          spanGaps: true,
          points: {show: data.columns[0].length < 60, size: 4},
          value: (u, v) => fmtNum(v),
        })),
      ],
    };
    const plot = new uPlot(options, data.columns, box);
    return {plot, box, signature: null};
  }

  resize() {
    const width = this.width();
    for (const chart of this.charts.values()) chart.plot.setSize({width, height: 240});
  }
}
