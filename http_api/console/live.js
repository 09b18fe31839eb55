// The live view: /v1/numaserve/stats about once a second, a card per worker and charts of the last minutes
// (plain SVG: no chart library to vendor).

import { getJSON } from "./api.js";
import { Chart } from "./chart.js";

const $ = (id) => document.getElementById(id);
const POLL_MS = 1000;
const HISTORY_S = 300; // what the charts show
const STAGES = ["schedule", "propose", "run", "sample", "process"];

export class Live {
  constructor(onError) {
    this.onError = onError;
    this.timer = null;
    this.previous = null; // the last answer, for CPU use between polls
    this.cardIds = null; // the workers the cards were built for, and whether each was up
    this.charts = {
      tokens: new Chart($("chart-tokens"), HISTORY_S),
      running: new Chart($("chart-running"), HISTORY_S),
      kv: new Chart($("chart-kv"), HISTORY_S),
      cpu: new Chart($("chart-cpu"), HISTORY_S),
    };
  }

  start() {
    if (this.timer === null) this.poll();
  }

  stop() {
    clearTimeout(this.timer);
    this.timer = null;
  }

  async poll() {
    this.timer = setTimeout(() => this.poll(), POLL_MS);
    let stats;
    try {
      stats = await getJSON("/v1/numaserve/stats");
    } catch (e) {
      this.onError(e);
      return;
    }
    this.show(stats);
    if (!this.previous || stats.time !== this.previous.time) this.previous = stats;
  }

  show(stats) {
    if (this.previous && stats.time === this.previous.time) return; // the same copy again: nothing new
    const serving = stats.workers.filter((w) => w.engine).length;
    setText($("live-summary"), stats.error
      ? `${stats.model}: ${stats.error}`
      : `${stats.model}: ${stats.workers.length} workers (${serving} answering), ${stats.num_routed} requests routed`);
    const cpu = new Map(stats.workers.filter((w) => w.engine).map((w) => [w.worker_id, this.cpuCores(w, stats.time)]));
    this.showCards(stats, cpu);
    for (const w of stats.workers) {
      const e = w.engine;
      if (!e) continue;
      this.charts.tokens.add(w.worker_id, stats.time, e.tokens_per_s);
      this.charts.running.add(w.worker_id, stats.time, e.num_running);
      this.charts.kv.add(w.worker_id, stats.time, 100 * e.kv_usage);
      if (cpu.get(w.worker_id) !== null) this.charts.cpu.add(w.worker_id, stats.time, cpu.get(w.worker_id));
    }
    for (const chart of Object.values(this.charts)) chart.draw(stats.time);
  }

  // A card per worker, built once (again when it goes down or comes back); each poll changes only the texts
  // that changed, so the browser repaints little.
  showCards(stats, cpu) {
    const ids = stats.workers.map((w) => `${w.worker_id}:${w.engine ? "up" : "down"}`).join(",");
    if (ids !== this.cardIds) {
      this.cardIds = ids;
      $("workers").replaceChildren(...stats.workers.map((w) => card(w)));
    }
    for (const w of stats.workers) {
      const element = $("workers").querySelector(`.worker-card[data-worker="${CSS.escape(w.worker_id)}"]`);
      for (const [field, text] of Object.entries(fields(w, cpu.get(w.worker_id)))) {
        setText(element.querySelector(`[data-field="${field}"]`), text);
      }
      if (w.engine) showStages(element.querySelector(".stages"), w.engine.stage_seconds);
    }
  }

  // Cores busy since the last poll: CPU seconds spent / seconds passed.
  cpuCores(w, time) {
    const before = this.previous && this.previous.workers.find((p) => p.worker_id === w.worker_id);
    if (!before || !before.engine || before.engine.cpu_seconds === null || w.engine.cpu_seconds === null) return null;
    const elapsed = time - this.previous.time;
    return elapsed > 0 ? Math.max(w.engine.cpu_seconds - before.engine.cpu_seconds, 0) / elapsed : null;
  }
}

// The texts of a worker's card, by field (cpu: its cores busy since the last poll, null: unknown).
function fields(w, cpu) {
  const where = `NUMA node ${w.numa_node ?? "-"} · cores ${cores(w.cpu_ids)}` + (w.machine ? ` · ${w.machine}` : "");
  const e = w.engine;
  if (!e) return { where, state: w.error || "down" };
  return {
    where,
    "tokens-per-s": e.tokens_per_s.toFixed(1),
    "prompt-tokens-per-s": e.prompt_tokens_per_s.toFixed(1),
    running: `${e.num_running} / ${e.num_waiting}`,
    kv: `${e.kv_used_blocks} / ${e.kv_total_blocks} (${(100 * e.kv_usage).toFixed(0)}%)`,
    prefix: `${(100 * e.prefix_hit_rate).toFixed(0)}%`,
    speculation: e.spec_method === "off" ? "off"
      : `${e.spec_method}, ${e.spec_acceptance === null ? "no drafts yet" : `${(100 * e.spec_acceptance).toFixed(0)}% accepted`}`,
    adapters: e.adapters_loaded.length ? e.adapters_loaded.join(", ") : "none",
    cpu: cpu === null ? "-" : `${cpu.toFixed(2)} cores`,
    "tensor-parallel": `${e.tensor_parallel_size}`,
  };
}

const ROWS = [["tokens/s", "tokens-per-s"], ["prompt tokens/s", "prompt-tokens-per-s"],
  ["running / waiting", "running"], ["KV blocks", "kv"], ["prefix cache hits", "prefix"],
  ["speculation", "speculation"], ["adapters", "adapters"], ["CPU", "cpu"], ["tensor parallel", "tensor-parallel"]];

function card(w) {
  const element = document.createElement("div");
  element.className = "worker-card";
  element.dataset.worker = w.worker_id;
  const title = document.createElement("h3");
  title.textContent = w.worker_id;
  const where = document.createElement("div");
  where.className = "where";
  where.dataset.field = "where";
  element.append(title, where);
  if (!w.engine) {
    element.classList.add("down");
    element.append(row("state", "state"));
    return element;
  }
  element.append(...ROWS.map(([label, field]) => row(label, field)));
  const stages = document.createElement("div");
  stages.className = "stages";
  const label = document.createElement("div");
  const bar = document.createElement("div");
  bar.className = "bar";
  for (const s of STAGES) {
    const part = document.createElement("span");
    part.className = `stage-${s}`;
    bar.append(part);
  }
  stages.append(label, bar);
  element.append(stages);
  return element;
}

function row(label, field) {
  const div = document.createElement("div");
  div.className = `row ${field}`;
  const name = document.createElement("span");
  name.textContent = label;
  const value = document.createElement("span");
  value.className = "value";
  value.dataset.field = field;
  div.append(name, value);
  return div;
}

function setText(element, text) {
  if (element.textContent !== text) element.textContent = text;
}

// The mean step of the last seconds, split by stage: a label and a bar of one part per stage.
function showStages(element, seconds) {
  const total = STAGES.reduce((sum, s) => sum + seconds[s], 0);
  setText(element.firstChild, total > 0 ? `step ${(1000 * total).toFixed(2)} ms: ` +
    STAGES.filter((s) => seconds[s] > 0).map((s) => `${s} ${(1000 * seconds[s]).toFixed(2)}`).join(", ")
    : "no steps in the last seconds");
  for (const part of element.lastChild.children) {
    const s = part.className.slice("stage-".length);
    const width = total > 0 ? `${(100 * seconds[s] / total).toFixed(1)}%` : "0%";
    if (part.style.width !== width) part.style.width = width;
    part.title = `${s}: ${(1000 * seconds[s]).toFixed(2)} ms`;
  }
}

// [0, 1, 2, 5] -> "0-2,5"
function cores(ids) {
  if (!ids.length) return "-";
  const runs = [];
  for (const c of [...ids].sort((a, b) => a - b)) {
    const last = runs[runs.length - 1];
    if (last && c === last[1] + 1) last[1] = c;
    else runs.push([c, c]);
  }
  return runs.map(([a, b]) => (a === b ? `${a}` : `${a}-${b}`)).join(",");
}
