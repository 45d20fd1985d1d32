// Loss and accuracy curves on a canvas, drawn by hand (no library, nothing from a CDN).
const COLORS = { train: "#2f6fde", val: "#ee4c2c" };

export function emptySeries(epochs = 1) {
  return { loss: { train: [], val: [] }, acc: { train: [], val: [] }, epochs };
}

// One epoch's metrics into the series (an epoch seen again replaces its points).
export function addMetrics(series, m) {
  const put = (arr, y) => {
    if (y === null || y === undefined) return;
    const i = arr.findIndex((pt) => pt[0] === m.epoch);
    if (i >= 0) arr[i] = [m.epoch, y]; else arr.push([m.epoch, y]);
    arr.sort((a, b) => a[0] - b[0]);
  };
  put(series.loss.train, m.train_loss); put(series.loss.val, m.val_loss);
  put(series.acc.train, m.train_accuracy); put(series.acc.val, m.val_accuracy);
}

export function drawCharts(series, lossCanvas, accCanvas) {
  const s = series || emptySeries();
  drawChart(lossCanvas, s.loss, { epochs: s.epochs, format: (v) => v.toFixed(2) });
  drawChart(accCanvas, s.acc, { epochs: s.epochs, min: 0, max: 1, format: (v) => `${Math.round(v * 100)}%` });
}

function drawChart(canvas, series, { epochs, min, max, format }) {
  const dpr = window.devicePixelRatio || 1;
  const width = canvas.clientWidth || 480, height = canvas.clientHeight || 220;
  if (canvas.width !== Math.round(width * dpr) || canvas.height !== Math.round(height * dpr)) {
    canvas.width = Math.round(width * dpr); canvas.height = Math.round(height * dpr);
  }
  const ctx = canvas.getContext("2d");
  ctx.setTransform(dpr, 0, 0, dpr, 0, 0);
  ctx.clearRect(0, 0, width, height);
  const all = [...series.train, ...series.val];
  canvas.dataset.points = String(all.length);
  const pad = { left: 44, right: 12, top: 24, bottom: 28 };
  const w = width - pad.left - pad.right, h = height - pad.top - pad.bottom;
  const ys = all.map((p) => p[1]);
  let lo = min !== undefined ? min : Math.min(...ys, Infinity);
  let hi = max !== undefined ? max : Math.max(...ys, -Infinity);
  if (!isFinite(lo) || !isFinite(hi)) { lo = 0; hi = 1; }
  if (min === undefined) lo = Math.max(0, lo - 0.1 * (hi - lo || 1));
  if (max === undefined) hi = hi + 0.1 * (hi - lo || 1);
  const xMax = Math.max(epochs || 1, ...all.map((p) => p[0]), 1);
  const x = (e) => pad.left + (xMax <= 1 ? w / 2 : ((e - 1) / (xMax - 1)) * w);
  const y = (v) => pad.top + h - ((v - lo) / (hi - lo || 1)) * h;

  ctx.font = "11px system-ui, sans-serif";
  ctx.lineWidth = 1;
  ctx.strokeStyle = "#e8ebf1"; ctx.fillStyle = "#6b7487";
  ctx.textAlign = "right"; ctx.textBaseline = "middle";
  for (let i = 0; i <= 4; i += 1) {
    const v = lo + ((hi - lo) * i) / 4;
    ctx.beginPath(); ctx.moveTo(pad.left, y(v)); ctx.lineTo(pad.left + w, y(v)); ctx.stroke();
    ctx.fillText(format(v), pad.left - 6, y(v));
  }
  ctx.textAlign = "center"; ctx.textBaseline = "top";
  const step = Math.max(1, Math.ceil(xMax / 10));
  for (let e = 1; e <= xMax; e += step) ctx.fillText(String(e), x(e), pad.top + h + 6);
  ctx.fillText("epoch", pad.left + w / 2, pad.top + h + 16 > height - 12 ? height - 12 : pad.top + h + 16);

  if (!all.length) {
    ctx.fillStyle = "#9aa3b5"; ctx.textBaseline = "middle";
    ctx.fillText("waiting for the first epoch…", pad.left + w / 2, pad.top + h / 2);
  }
  for (const [name, points] of Object.entries(series)) {
    if (!points.length) continue;
    ctx.strokeStyle = COLORS[name]; ctx.fillStyle = COLORS[name]; ctx.lineWidth = 2;
    ctx.beginPath();
    points.forEach(([e, v], i) => (i ? ctx.lineTo(x(e), y(v)) : ctx.moveTo(x(e), y(v))));
    ctx.stroke();
    for (const [e, v] of points) { ctx.beginPath(); ctx.arc(x(e), y(v), 3, 0, 2 * Math.PI); ctx.fill(); }
  }
  ctx.textAlign = "left"; ctx.textBaseline = "middle"; ctx.lineWidth = 2;
  let lx = pad.left + w - 110;
  for (const name of ["train", "val"]) {
    ctx.strokeStyle = COLORS[name]; ctx.fillStyle = "#4a5366";
    ctx.beginPath(); ctx.moveTo(lx, 9); ctx.lineTo(lx + 16, 9); ctx.stroke();
    ctx.fillText(name, lx + 20, 9);
    lx += 56;
  }
}
