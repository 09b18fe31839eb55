// A line chart of the last seconds in plain SVG: one line per series, the y axis from 0 to the largest value.

const SVG = "http://www.w3.org/2000/svg";
const WIDTH = 480;
const HEIGHT = 160;
const PAD = { left: 44, right: 8, top: 8, bottom: 20 };
const COLORS = ["#2f6fdf", "#e0702b", "#2a9d58", "#b03bb5", "#c4a000", "#17a2b8", "#d6336c", "#6c757d"];

export class Chart {
  constructor(svg, historyS) {
    this.svg = svg;
    this.historyS = historyS;
    this.series = new Map(); // name -> [[time, value], ...], oldest first
    svg.setAttribute("viewBox", `0 0 ${WIDTH} ${HEIGHT}`);
  }

  add(name, time, value) {
    if (!this.series.has(name)) this.series.set(name, []);
    this.series.get(name).push([time, value]);
  }

  draw(now) {
    const since = now - this.historyS;
    let top = 0;
    for (const points of this.series.values()) {
      while (points.length && points[0][0] < since) points.shift();
      for (const [, v] of points) top = Math.max(top, v);
    }
    top = niceCeiling(top);
    const x = (t) => PAD.left + (WIDTH - PAD.left - PAD.right) * (t - since) / this.historyS;
    const y = (v) => HEIGHT - PAD.bottom - (HEIGHT - PAD.top - PAD.bottom) * v / top;
    const parts = [
      element("line", { x1: PAD.left, x2: WIDTH - PAD.right, y1: y(0), y2: y(0), class: "axis" }),
      element("line", { x1: PAD.left, x2: WIDTH - PAD.right, y1: y(top), y2: y(top), class: "grid" }),
      text(PAD.left - 4, y(top) + 4, formatValue(top), "end"),
      text(PAD.left - 4, y(0) + 4, "0", "end"),
      text(PAD.left, HEIGHT - 4, `-${Math.round(this.historyS / 60)} min`, "start"),
      text(WIDTH - PAD.right, HEIGHT - 4, "now", "end"),
    ];
    let i = 0;
    for (const [name, points] of this.series) {
      const color = COLORS[i % COLORS.length];
      if (points.length) {
        parts.push(element("polyline", {
          points: points.map(([t, v]) => `${x(t).toFixed(1)},${y(v).toFixed(1)}`).join(" "),
          stroke: color, class: "line",
        }));
      }
      parts.push(text(PAD.left + 6, PAD.top + 12 + 12 * i, name, "start", color));
      i += 1;
    }
    this.svg.replaceChildren(...parts);
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
