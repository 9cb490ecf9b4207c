/* perdure web: images from media.jsonl, one panel per tag with a step slider and one row per run (as `spt web`
   does). A row shows the run's images at the newest step not after the slider's. */
"use strict";

class MediaBoard {
  constructor(container) {
    this.container = container;
    this.runs = [];
    this.panels = new Map();  // tag -> {box, signature, steps, follow, index}
  }

  /* runs: [{id, color, media: [{tag, step, index, url}]}] */
  setRuns(runs) {
    this.runs = runs;
    this.render();
  }

  render() {
    const byTag = new Map();
    for (const run of this.runs) {
      for (const item of run.media || []) {
        if (!byTag.has(item.tag)) byTag.set(item.tag, new Map());
        const perRun = byTag.get(item.tag);
        if (!perRun.has(run.id)) perRun.set(run.id, []);
        perRun.get(run.id).push(item);
      }
    }
    for (const [tag, panel] of this.panels) {
      if (!byTag.has(tag)) { panel.box.remove(); this.panels.delete(tag); }
    }
    if (!byTag.size) {
      this.container.replaceChildren(el("p", {class: "empty"}, this.runs.length
        ? "No images logged (runs log them with runner.log_image)." : "Select runs in the table to see their images."));
      return;
    }
    for (const node of [...this.container.children]) if (!node.classList.contains("media-panel")) node.remove();
    [...byTag.keys()].sort().forEach((tag, position) => {
      const perRun = byTag.get(tag);
      const steps = [...new Set([...perRun.values()].flat().map((item) => item.step))].sort((a, b) => a - b);
      const runs = this.runs.filter((run) => perRun.has(run.id));
      const signature = JSON.stringify([steps, runs.map((r) => [r.id, r.color, perRun.get(r.id).map((i) => i.url)])]);
      let panel = this.panels.get(tag);
      if (!panel || panel.signature !== signature) {
        const previous = panel;
        panel = this.build(tag, steps, runs, perRun);
        panel.signature = signature;
        if (previous) {
          panel.follow = previous.follow;
          if (!previous.follow) panel.index = Math.max(0, steps.filter((s) => s <= previous.steps[previous.index]).length - 1);
          previous.box.replaceWith(panel.box);
        }
        this.panels.set(tag, panel);
        this.show(panel);
      }
      if (this.container.children[position] !== panel.box) {
        this.container.insertBefore(panel.box, this.container.children[position] || null);
      }
    });
  }

  build(tag, steps, runs, perRun) {
    const slider = el("input", {type: "range", min: 0, max: steps.length - 1, step: 1, value: steps.length - 1,
      "aria-label": `step of ${tag}`});
    const label = el("span", {class: "step-label mono"});
    const rows = runs.map((run) => ({
      run,
      items: perRun.get(run.id).slice().sort((a, b) => a.step - b.step || a.index - b.index),
      images: el("div", {class: "images"}),
      caption: el("span", {class: "muted"}),
    }));
    const box = el("div", {class: "media-panel", "data-tag": tag},
      el("h3", {}, tag),
      el("div", {class: "slider"}, slider, label),
      rows.map((row) => el("div", {class: "media-row", "data-run": row.run.id},
        el("div", {class: "who"}, swatch(row.run.color), row.run.id), row.images, row.caption)));
    const panel = {box, steps, rows, slider, label, follow: true, index: steps.length - 1};
    slider.addEventListener("input", () => {
      panel.index = Number(slider.value);
      panel.follow = panel.index === steps.length - 1;
      this.show(panel);
    });
    return panel;
  }

  show(panel) {
    if (panel.follow) panel.index = panel.steps.length - 1;
    panel.slider.value = String(panel.index);
    const step = panel.steps[panel.index];
    panel.label.textContent = `step ${step}  (${panel.index + 1} of ${panel.steps.length})`;
    for (const row of panel.rows) {
      const upto = row.items.filter((item) => item.step <= step);
      const shown = upto.length ? upto[upto.length - 1].step : null;
      const items = upto.filter((item) => item.step === shown);
      const current = [...row.images.children].map((img) => img.getAttribute("src"));
      const wanted = items.map((item) => item.url);
      if (JSON.stringify(current) !== JSON.stringify(wanted)) {
        row.images.replaceChildren(...items.map((item) =>
          el("img", {src: item.url, alt: `${panel.box.dataset.tag} step ${item.step}`, title: `step ${item.step}`})));
      }
      row.caption.textContent = shown === null ? "no image yet at this step" : shown === step ? "" : `(from step ${shown})`;
    }
  }
}
