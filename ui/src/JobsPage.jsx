// "Training jobs" in Airflow's navigation: every job the user may see, newest first, refreshed while any runs.
import { getJson, isActive } from "./api";
import { Sparkline } from "./charts";
import { cell, ErrorLine, head, PhaseBadge, usePolling } from "./common";
import { color, elapsed, when } from "./format";

const PHASES = ["", "pending", "running", "succeeded", "failed"];

export default function JobsPage() {
  const { useState } = React;
  const [dagId, setDagId] = useState("");
  const [phase, setPhase] = useState("");
  const { data, error, loading } = usePolling(
    () => getJson("jobs", { dag_id: dagId.trim(), phase, limit: 100 }),
    [dagId, phase],
    (d) => d.jobs.some((job) => isActive(job.phase)),
  );
  const jobs = data?.jobs || [];
  const input = { padding: "4px 8px", border: `1px solid ${color.border}`, borderRadius: 4, background: "transparent", color: color.fg };
  return (
    <div style={{ padding: 16, color: color.fg }} data-testid="training-jobs">
      <h2 style={{ fontSize: 22, fontWeight: 700, margin: "0 0 12px" }}>Training jobs</h2>
      <div style={{ display: "flex", gap: 12, marginBottom: 12, alignItems: "center" }}>
        <label>
          DAG <input style={input} value={dagId} placeholder="any dag_id" onChange={(e) => setDagId(e.target.value)} data-testid="filter-dag" />
        </label>
        <label>
          State{" "}
          <select style={input} value={phase} onChange={(e) => setPhase(e.target.value)} data-testid="filter-phase">
            {PHASES.map((p) => (
              <option key={p} value={p}>{p || "any"}</option>
            ))}
          </select>
        </label>
        {jobs.some((job) => isActive(job.phase)) && <span style={{ color: color.muted, fontSize: 12 }}>refreshing every 5 s</span>}
      </div>
      <ErrorLine error={error} />
      {/* One line per namespace that could not be listed (the server words it): the others' running jobs are shown. */}
      {Object.entries(data?.kubernetes_errors || {}).map(([namespace, line]) => (
        <p key={namespace} role="alert" data-testid="namespace-error" data-namespace={namespace} style={{ color: color.muted }}>
          {line}
        </p>
      ))}
      {loading ? <p>Loading…</p> : !jobs.length ? (
        <p style={{ color: color.muted }}>No training jobs{dagId || phase ? " match these filters" : " yet"}.</p>
      ) : (
        <table style={{ borderCollapse: "collapse", width: "100%" }}>
          <thead>
            <tr>
              {["State", "DAG / task", "Run", "Try", "Job", "Pods", "Started", "Elapsed", "Loss", "Root cause"].map((h) => (
                <th key={h} style={head}>{h}</th>
              ))}
            </tr>
          </thead>
          <tbody>
            {jobs.map((job) => (
              <tr key={`${job.namespace}/${job.name}`} data-testid="job-row" data-job={job.name} data-phase={job.phase}>
                <td style={cell}><PhaseBadge phase={job.phase} /></td>
                <td style={cell}>
                  <a href={job.ti_url} style={{ color: color.line }}>{job.dag_id} / {job.task_id}{job.map_index >= 0 ? ` [${job.map_index}]` : ""}</a>
                </td>
                <td style={{ ...cell, fontSize: 12 }}>{job.run_id}</td>
                <td style={cell}>{job.try_number ?? ""}</td>
                <td style={{ ...cell, fontSize: 12 }}>{job.kind}<br /><span style={{ color: color.muted }}>{job.namespace}/{job.name}</span></td>
                <td style={cell} data-testid="pods">{job.pods_running}/{job.pods_total}</td>
                <td style={{ ...cell, fontSize: 12 }}>{when(job.created)}</td>
                <td style={cell}>{elapsed(job.elapsed_seconds)}</td>
                <td style={cell}><Sparkline line={job.sparkline} /></td>
                <td style={{ ...cell, fontSize: 12, maxWidth: 360 }}>{job.root_cause || ""}</td>
              </tr>
            ))}
          </tbody>
        </table>
      )}
    </div>
  );
}
