// A small canvas line chart for the dashboard: time on x, several named series on y, gaps where a
// value is null. No library, so the page loads nothing but chatd's own files.
"use strict";

const PALETTE = ["#2f6feb", "#d4a72c", "#cf222e", "#1a7f37", "#8250df", "#bf3989"];

class LineChart {
  // integer: counts, so the axis never shows fractions (its top is at least 4).
  constructor(canvas, {unit = "", format = (v) => String(+v.toFixed(2)), min = 0, max = null, integer = false} = {}) {
    this.canvas = canvas;
    this.unit = unit;
    this.format = format;
    this.min = min;
    this.max = max;
    this.integer = integer;
  }

  // series: [{name, points: [[t, value|null], ...]}]; t in unix seconds.
  draw(series) {
    const canvas = this.canvas;
    const ratio = window.devicePixelRatio || 1;
    const width = canvas.clientWidth;
    const height = canvas.clientHeight;
    canvas.width = Math.round(width * ratio);
    canvas.height = Math.round(height * ratio);
    const ctx = canvas.getContext("2d");
    ctx.setTransform(ratio, 0, 0, ratio, 0, 0);
    ctx.clearRect(0, 0, width, height);
    const style = getComputedStyle(canvas);
    const text = style.getPropertyValue("--chart-text").trim() || "#656d76";
    const grid = style.getPropertyValue("--chart-grid").trim() || "#d8dee4";
    ctx.font = "11px system-ui, sans-serif";

    const values = series.flatMap((s) => s.points.map((p) => p[1]).filter((v) => v !== null && isFinite(v)));
    const times = series.flatMap((s) => s.points.map((p) => p[0]));
    canvas.dataset.points = String(values.length);
    const left = 52, right = 10, top = 24, bottom = 22;
    const plotWidth = width - left - right, plotHeight = height - top - bottom;
    if (!times.length) return;
    const t0 = Math.min(...times), t1 = Math.max(...times);
    let high = this.max ?? Math.max(...values, 0);
    if (high <= this.min) high = this.min + 1;
    high = this.integer ? Math.max(4, Math.ceil(high / 4) * 4) : niceCeiling(high / 4) * 4;
    const x = (t) => left + (t1 === t0 ? plotWidth : ((t - t0) / (t1 - t0)) * plotWidth);
    const y = (v) => top + plotHeight - ((v - this.min) / (high - this.min)) * plotHeight;

    ctx.strokeStyle = grid;
    ctx.fillStyle = text;
    ctx.lineWidth = 1;
    ctx.textAlign = "right";
    ctx.textBaseline = "middle";
    for (let i = 0; i <= 4; i++) {
      const v = this.min + ((high - this.min) * i) / 4;
      ctx.beginPath();
      ctx.moveTo(left, Math.round(y(v)) + 0.5);
      ctx.lineTo(width - right, Math.round(y(v)) + 0.5);
      ctx.stroke();
      ctx.fillText(`${this.format(v)}${this.unit}`, left - 6, y(v));
    }
    ctx.textAlign = "center";
    ctx.textBaseline = "top";
    for (const t of [t0, (t0 + t1) / 2, t1]) {
      ctx.fillText(new Date(t * 1000).toLocaleTimeString([], {hour: "2-digit", minute: "2-digit", second: "2-digit"}),
        Math.min(Math.max(x(t), left + 24), width - right - 24), height - bottom + 6);
    }

    let legendX = left;
    series.forEach((s, index) => {
      const color = s.color || PALETTE[index % PALETTE.length];
      ctx.strokeStyle = color;
      ctx.fillStyle = color;
      ctx.lineWidth = 2;
      ctx.beginPath();
      let drawing = false;
      for (const [t, v] of s.points) {
        if (v === null || !isFinite(v)) { drawing = false; continue; }
        if (drawing) ctx.lineTo(x(t), y(v)); else ctx.moveTo(x(t), y(v));
        drawing = true;
      }
      ctx.stroke();
      for (const [t, v] of s.points) {  // dots, so that a lone point between gaps shows
        if (v !== null && isFinite(v)) ctx.fillRect(x(t) - 1.5, y(v) - 1.5, 3, 3);
      }
      ctx.textAlign = "left";
      ctx.textBaseline = "middle";
      ctx.fillRect(legendX, 9, 10, 3);
      ctx.fillStyle = text;
      ctx.fillText(s.name, legendX + 14, 10);
      legendX += 22 + ctx.measureText(s.name).width;
    });
  }
}

// The smallest round step (1, 1.5, 2, 2.5, 3, 4, 5, 6, 8 times a power of ten) at or above value.
function niceCeiling(value) {
  const power = 10 ** Math.floor(Math.log10(value));
  for (const step of [1, 1.5, 2, 2.5, 3, 4, 5, 6, 8, 10]) {
    if (value <= step * power) return step * power;
  }
  return 10 * power;
}
