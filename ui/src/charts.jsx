// Hand-drawn SVG charts: a sparkline for the jobs table, a line chart per metric for a job. Each reported point is
// one <circle> in the line chart (data-step, data-value), so what is drawn can be checked point by point.
import { cell, head } from "./common";
import { color, number } from "./format";

function scale(points, width, height, pad, left = pad) {
  const steps = points.map((p) => p[0]);
  const values = points.map((p) => p[1]).filter((v) => Number.isFinite(v));
  const [x0, x1] = [Math.min(...steps), Math.max(...steps)];
  let [y0, y1] = [Math.min(...values), Math.max(...values)];
  if (y0 === y1) [y0, y1] = [y0 - 1, y1 + 1];
  const span = width - left - pad;
  const x = (s) => left + (x1 === x0 ? span / 2 : ((s - x0) / (x1 - x0)) * span);
  const y = (v) => height - pad - ((v - y0) / (y1 - y0)) * (height - 2 * pad);
  return { x, y, x0, x1, y0, y1 };
}

const finite = (points) => (points || []).filter((p) => Number.isFinite(p[0]) && Number.isFinite(p[1]));

export function Sparkline({ line, width = 120, height = 28 }) {
  const points = finite(line?.points);
  if (!points.length) return <span style={{ color: color.muted }}>–</span>;
  const { x, y } = scale(points, width, height, 3);
  const path = points.map((p) => `${x(p[0]).toFixed(1)},${y(p[1]).toFixed(1)}`).join(" ");
  const last = points[points.length - 1];
  return (
    <span style={{ display: "inline-flex", alignItems: "center", gap: 6 }} title={`${line.metric} at step ${last[0]}`}>
      <svg width={width} height={height} data-testid="sparkline" data-metric={line.metric} data-points={points.length}>
        <polyline points={path} fill="none" stroke={color.line} strokeWidth="1.5" />
      </svg>
      <span style={{ fontSize: 12, color: color.muted }}>
        {line.metric} {number(last[1])}
      </span>
    </span>
  );
}

export function LineChart({ name, points: raw, width = 420, height = 180 }) {
  const points = finite(raw);
  const pad = 24;
  const left = 64; // room for the value labels
  if (!points.length) return null;
  const { x, y, x0, x1, y0, y1 } = scale(points, width, height, pad, left);
  const path = points.map((p) => `${x(p[0]).toFixed(1)},${y(p[1]).toFixed(1)}`).join(" ");
  const axis = { stroke: color.border, strokeWidth: 1 };
  const label = { fontSize: 10, fill: color.muted };
  return (
    <figure style={{ margin: 0, border: `1px solid ${color.border}`, borderRadius: 6, padding: 8 }}>
      <figcaption style={{ fontWeight: 600, marginBottom: 4 }}>
        {name} <span style={{ fontWeight: 400, color: color.muted }}>(last {number(points[points.length - 1][1])})</span>
      </figcaption>
      <svg width={width} height={height} data-testid="metric-chart" data-metric={name} role="img" aria-label={`${name} over steps`}>
        <line x1={left} y1={height - pad} x2={width - pad} y2={height - pad} {...axis} />
        <line x1={left} y1={pad} x2={left} y2={height - pad} {...axis} />
        <text x={left} y={height - pad + 14} {...label}>{`step ${x0}`}</text>
        <text x={width - pad} y={height - pad + 14} textAnchor="end" {...label}>{`${x1}`}</text>
        <text x={left - 4} y={pad + 4} textAnchor="end" {...label}>{number(y1)}</text>
        <text x={left - 4} y={height - pad} textAnchor="end" {...label}>{number(y0)}</text>
        <polyline points={path} fill="none" stroke={color.line} strokeWidth="2" />
        {/* Keyed by position: a framework may log a metric twice at one step (the HF Trainer's end-of-training log
            repeats `epoch`). */}
        {points.map((p, i) => (
          <circle key={i} cx={x(p[0])} cy={y(p[1])} r={points.length > 60 ? 1.5 : 3} fill={color.line}
            data-step={p[0]} data-value={p[1]}>
            <title>{`step ${p[0]}: ${number(p[1])}`}</title>
          </circle>
        ))}
      </svg>
    </figure>
  );
}

// Losses first, then by name: the summary's keys come back from the database in its own order (PostgreSQL's jsonb
// sorts them by length), which no person would look for a metric in.
const byName = ([a], [b]) => Number(!/loss/i.test(a)) - Number(!/loss/i.test(b)) || a.localeCompare(b);

// Metrics reported once: a framework's end-of-training totals (the HF Trainer's train_runtime, total_flos,
// train_loss), a value rather than a curve.
function Values({ values }) {
  return (
    <table style={{ borderCollapse: "collapse", marginTop: 12 }} data-testid="metric-values">
      <thead>
        <tr>{["Reported once", "Step", "Value"].map((h) => <th key={h} style={head}>{h}</th>)}</tr>
      </thead>
      <tbody>
        {values.map(([name, [[step, value]]]) => (
          <tr key={name} data-testid="metric-value" data-metric={name} data-step={step} data-value={value}>
            <td style={{ ...cell, fontWeight: 600 }}>{name}</td>
            <td style={cell}>{step}</td>
            <td style={{ ...cell, fontVariantNumeric: "tabular-nums" }}>{number(value)}</td>
          </tr>
        ))}
      </tbody>
    </table>
  );
}

export function Charts({ metrics }) {
  const series = Object.entries(metrics || {})
    .map(([name, points]) => [name, finite(points)])
    .filter(([, points]) => points.length)
    .sort(byName);
  if (!series.length) return <p style={{ color: color.muted }}>No metrics reported (call report() in the training function).</p>;
  const curves = series.filter(([, points]) => points.length > 1);
  const values = series.filter(([, points]) => points.length === 1);
  return (
    <div>
      <div style={{ display: "flex", flexWrap: "wrap", gap: 12 }}>
        {curves.map(([name, points]) => (
          <LineChart key={name} name={name} points={points} />
        ))}
      </div>
      {values.length > 0 && <Values values={values} />}
    </div>
  );
}
