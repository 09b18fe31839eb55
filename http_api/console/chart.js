// A line chart of the last seconds in plain SVG: one line per series, the y axis from 0 to a round number
// above the largest value. Its elements are made once; a redraw changes their attributes.

const SVG = "http://www.w3.org/2000/svg";
const WIDTH = 480;
const HEIGHT = 160;
const PAD = { left: 44, right: 8, top: 8, bottom: 20 };
const COLORS = ["#2f6fdf", "#e0702b", "#2a9d58", "#b03bb5", "#c4a000", "#17a2b8", "#d6336c", "#6c757d"];

export class Chart {
  constructor(svg, historyS) {
    this.svg = svg;
    this.historyS = historyS;
    this.series = new Map(); // name -> {points: [[time, value], ...] oldest first, line, legend}
    svg.setAttribute("viewBox", `0 0 ${WIDTH} ${HEIGHT}`);
    const y0 = HEIGHT - PAD.bottom;
    svg.append(
      element("line", { x1: PAD.left, x2: WIDTH - PAD.right, y1: y0, y2: y0, class: "axis" }),
      element("line", { x1: PAD.left, x2: WIDTH - PAD.right, y1: PAD.top, y2: PAD.top, class: "grid" }),
      text(PAD.left - 4, y0 + 4, "0", "end"),
      text(PAD.left, HEIGHT - 4, `-${Math.round(historyS / 60)} min`, "start"),
      text(WIDTH - PAD.right, HEIGHT - 4, "now", "end"),
    );
    this.topLabel = text(PAD.left - 4, PAD.top + 4, "", "end");
    svg.append(this.topLabel);
  }

  add(name, time, value) {
    if (!this.series.has(name)) {
      const color = COLORS[this.series.size % COLORS.length];
      const line = element("polyline", { stroke: color, class: "line" });
      const legend = text(PAD.left + 6, PAD.top + 12 + 12 * this.series.size, name, "start", color);
      this.svg.append(line, legend);
      this.series.set(name, { points: [], line });
    }
    this.series.get(name).points.push([time, value]);
  }

  draw(now) {
    const since = now - this.historyS;
    let top = 0;
    for (const { points } of this.series.values()) {
      while (points.length && points[0][0] < since) points.shift();
      for (const [, v] of points) top = Math.max(top, v);
    }
    top = niceCeiling(top);
    const label = formatValue(top);
    if (this.topLabel.textContent !== label) this.topLabel.textContent = label;
    const x = (t) => PAD.left + (WIDTH - PAD.left - PAD.right) * (t - since) / this.historyS;
    const y = (v) => HEIGHT - PAD.bottom - (HEIGHT - PAD.top - PAD.bottom) * v / top;
    for (const { points, line } of this.series.values()) {
      line.setAttribute("points", points.map(([t, v]) => `${x(t).toFixed(1)},${y(v).toFixed(1)}`).join(" "));
    }
  }
}

function niceCeiling(v) {
  if (!(v > 0)) return 1;
  const step = 10 ** Math.floor(Math.log10(v));
  return [1, 2, 5, 10].map((m) => m * step).find((c) => c >= v);
}

function formatValue(v) {
  return v >= 100 ? v.toFixed(0) : v >= 1 ? v.toPrecision(2) : v.toPrecision(1);
}

function element(name, attributes) {
  const e = document.createElementNS(SVG, name);
  for (const [k, v] of Object.entries(attributes)) e.setAttribute(k, v);
  return e;
}

function text(x, y, content, anchor, color) {
  const e = element("text", { x, y, "text-anchor": anchor, class: "label" });
  if (color) e.setAttribute("fill", color);
  e.textContent = content;
  return e;
}
