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
    this.previous = stats;
  }

  show(stats) {
    const serving = stats.workers.filter((w) => w.engine).length;
    $("live-summary").textContent = stats.error
      ? `${stats.model}: ${stats.error}`
      : `${stats.model}: ${stats.workers.length} workers (${serving} answering), ${stats.num_routed} requests routed`;
    const cards = stats.workers.map((w) => this.card(w, stats.time));
    $("workers").replaceChildren(...cards);
    for (const w of stats.workers) {
      const e = w.engine;
      if (!e) continue;
      this.charts.tokens.add(w.worker_id, stats.time, e.tokens_per_s);
      this.charts.running.add(w.worker_id, stats.time, e.num_running);
      this.charts.kv.add(w.worker_id, stats.time, 100 * e.kv_usage);
      const cpu = this.cpuCores(w, stats.time);
      if (cpu !== null) this.charts.cpu.add(w.worker_id, stats.time, cpu);
    }
    for (const chart of Object.values(this.charts)) chart.draw(stats.time);
  }

  // Cores busy since the last poll: CPU seconds spent / seconds passed.
  cpuCores(w, time) {
    const before = this.previous && this.previous.workers.find((p) => p.worker_id === w.worker_id);
    if (!before || !before.engine || before.engine.cpu_seconds === null || w.engine.cpu_seconds === null) return null;
    const elapsed = time - this.previous.time;
    return elapsed > 0 ? Math.max(w.engine.cpu_seconds - before.engine.cpu_seconds, 0) / elapsed : null;
  }

  card(w, time) {
    const card = document.createElement("div");
    card.className = "worker-card";
    card.dataset.worker = w.worker_id;
    const title = document.createElement("h3");
    title.textContent = w.worker_id;
    const where = document.createElement("div");
    where.className = "where";
    where.textContent = `NUMA node ${w.numa_node ?? "-"} · cores ${cores(w.cpu_ids)}` +
      (w.machine ? ` · ${w.machine}` : "");
    card.append(title, where);
    if (!w.engine) {
      card.classList.add("down");
      card.append(row("state", w.error || "down"));
      return card;
    }
    const e = w.engine;
    const cpu = this.cpuCores(w, time);
    card.append(
      row("tokens/s", e.tokens_per_s.toFixed(1), "tokens-per-s"),
      row("prompt tokens/s", e.prompt_tokens_per_s.toFixed(1)),
      row("running / waiting", `${e.num_running} / ${e.num_waiting}`, "running"),
      row("KV blocks", `${e.kv_used_blocks} / ${e.kv_total_blocks} (${(100 * e.kv_usage).toFixed(0)}%)`, "kv"),
      row("prefix cache hits", `${(100 * e.prefix_hit_rate).toFixed(0)}%`),
      row("speculation", e.spec_method === "off" ? "off"
        : `${e.spec_method}, ${e.spec_acceptance === null ? "no drafts yet" : `${(100 * e.spec_acceptance).toFixed(0)}% accepted`}`),
      row("adapters", e.adapters_loaded.length ? e.adapters_loaded.join(", ") : "none", "adapters"),
      row("CPU", cpu === null ? "-" : `${cpu.toFixed(2)} cores`),
      row("tensor parallel", `${e.tensor_parallel_size}`),
      stageBar(e.stage_seconds),
    );
    return card;
  }
}

function row(label, value, cls) {
  const div = document.createElement("div");
  div.className = "row" + (cls ? ` ${cls}` : "");
  const name = document.createElement("span");
  name.textContent = label;
  const text = document.createElement("span");
  text.className = "value";
  text.textContent = value;
  div.append(name, text);
  return div;
}

// The mean step of the last seconds, split by stage.
function stageBar(seconds) {
  const total = STAGES.reduce((sum, s) => sum + seconds[s], 0);
  const div = document.createElement("div");
  div.className = "stages";
  const label = document.createElement("div");
  label.textContent = total > 0 ? `step ${(1000 * total).toFixed(2)} ms: ` +
    STAGES.filter((s) => seconds[s] > 0).map((s) => `${s} ${(1000 * seconds[s]).toFixed(2)}`).join(", ")
    : "no steps in the last seconds";
  const bar = document.createElement("div");
  bar.className = "bar";
  for (const s of STAGES) {
    if (!(total > 0 && seconds[s] > 0)) continue;
    const part = document.createElement("span");
    part.className = `stage-${s}`;
    part.style.width = `${100 * seconds[s] / total}%`;
    part.title = `${s}: ${(1000 * seconds[s]).toFixed(2)} ms`;
    bar.append(part);
  }
  div.append(label, bar);
  return div;
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
