import { color, phaseColor } from "./format";

export function PhaseBadge({ phase }) {
  return (
    <span data-testid="phase" data-phase={phase}
      style={{ display: "inline-block", padding: "1px 8px", borderRadius: 10, fontSize: 12, fontWeight: 600,
        color: "white", background: phaseColor[phase] || color.muted }}>
      {phase}
    </span>
  );
}

export const cell = { padding: "6px 10px", borderBottom: `1px solid ${color.border}`, textAlign: "left", verticalAlign: "top" };
export const head = { ...cell, fontWeight: 600, color: color.muted, fontSize: 12, textTransform: "uppercase" };

export function ErrorLine({ error }) {
  if (!error) return null;
  return <p role="alert" style={{ color: phaseColor.failed }}>Could not load training jobs: {String(error.message || error)}</p>;
}

// Polls `load` every `interval` ms while `active(data)` says jobs still run, else every `idle` ms (new jobs appear).
export function usePolling(load, deps, active, interval = 5000, idle = 15000) {
  const { useEffect, useState } = React;
  const [state, setState] = useState({ data: null, error: null, loading: true });
  useEffect(() => {
    let stopped = false;
    let timer = null;
    const tick = async () => {
      try {
        const data = await load();
        if (stopped) return;
        setState({ data, error: null, loading: false });
        timer = setTimeout(tick, active(data) ? interval : idle);
      } catch (error) {
        if (stopped) return;
        setState((prev) => ({ ...prev, error, loading: false }));
        timer = setTimeout(tick, idle);
      }
    };
    tick();
    return () => {
      stopped = true;
      clearTimeout(timer);
    };
  }, deps);
  return state;
}
