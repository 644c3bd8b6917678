export function elapsed(seconds) {
  if (seconds === null || seconds === undefined) return "";
  const s = Math.max(0, Math.round(seconds));
  const h = Math.floor(s / 3600);
  const m = Math.floor((s % 3600) / 60);
  const rest = String(s % 60).padStart(2, "0");
  return h ? `${h}h${String(m).padStart(2, "0")}m${rest}s` : `${m}m${rest}s`;
}

export function when(unix) {
  if (!unix) return "";
  return new Date(unix * 1000).toLocaleString();
}

export function number(value) {
  if (typeof value !== "number") return String(value);
  if (Math.abs(value) >= 1000 || Number.isInteger(value)) return String(value);
  // A learning rate (1e-2 to 1e-5 in every framework): "1.67e-3" fits beside a chart's axis, "0.001667" does not.
  if (Math.abs(value) < 0.01) return value.toExponential(2);
  return value.toPrecision(4);
}

// A size in bytes as people read it: 512 B, 4.0 KiB, 1.50 GiB.
export function size(bytes) {
  if (typeof bytes !== "number" || bytes < 0) return "";
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let value = bytes;
  let unit = 0;
  while (value >= 1024 && unit < units.length - 1) {
    value /= 1024;
    unit += 1;
  }
  return unit === 0 ? `${value} B` : `${value.toFixed(value < 10 ? 2 : 1)} ${units[unit]}`;
}

// Chakra's semantic colour tokens of Airflow's theme, with fallbacks for a page outside it.
export const color = {
  fg: "var(--chakra-colors-fg, #1a202c)",
  muted: "var(--chakra-colors-fg-muted, #718096)",
  border: "var(--chakra-colors-border, #e2e8f0)",
  subtle: "var(--chakra-colors-bg-subtle, #f7fafc)",
  line: "var(--chakra-colors-blue-500, #3182ce)",
};

export const phaseColor = {
  pending: "var(--chakra-colors-gray-500, #718096)",
  running: "var(--chakra-colors-cyan-500, #00b5d8)",
  succeeded: "var(--chakra-colors-green-600, #2f855a)",
  failed: "var(--chakra-colors-red-600, #c53030)",
};
