// The "Training job" tab of a task instance: that task instance's job (its latest try), pods, root cause, log
// tails and metric charts. Airflow 3.3 shows the tab on every task instance; other tasks get one line saying so.
import { getJson, isActive } from "./api";
import { Charts } from "./charts";
import { cell, ErrorLine, head, PhaseBadge, usePolling } from "./common";
import { color, elapsed, phaseColor, size, when } from "./format";

const nowrap = { whiteSpace: "nowrap" };

async function loadJob({ dagId, runId, taskId, mapIndex }) {
  const index = mapIndex === undefined || mapIndex === null || mapIndex === "" ? -1 : Number(mapIndex);
  const { jobs } = await getJson("jobs", { dag_id: dagId, run_id: runId, task_id: taskId, map_index: index, limit: 20 });
  if (!jobs.length) return { job: null };
  const latest = jobs.reduce((a, b) => ((b.try_number ?? 0) > (a.try_number ?? 0) ? b : a));
  const job = await getJson(`jobs/${encodeURIComponent(latest.namespace)}/${encodeURIComponent(latest.name)}`);
  return { job };
}

// A pod's reason and message; a long message (a traceback in the termination message) folds after its first line.
function Reason({ pod }) {
  const text = [pod.reason, pod.message].filter(Boolean).join(": ");
  if (text.length <= 160) return text;
  return (
    <details>
      <summary style={{ cursor: "pointer" }}>{text.slice(0, 140)}…</summary>
      <pre style={{ whiteSpace: "pre-wrap", fontSize: 11, margin: 0 }}>{text}</pre>
    </details>
  );
}

function Pods({ pods }) {
  return (
    <table style={{ borderCollapse: "collapse", width: "100%" }} data-testid="pods-table">
      <thead>
        <tr>{["Pod", "Replica", "Ranks", "Phase", "Node", "Restarts", "Reason", "Exit code"].map((h) => <th key={h} style={head}>{h}</th>)}</tr>
      </thead>
      <tbody>
        {pods.map((pod) => (
          <tr key={pod.name} data-testid="pod-row" data-pod={pod.name} data-phase={pod.phase}>
            <td style={{ ...cell, fontSize: 12 }}>{pod.name}</td>
            <td style={cell}>{pod.replica_type} {pod.replica_index ?? ""}</td>
            <td style={cell}>{(pod.ranks || []).join(", ")}</td>
            <td style={{ ...cell, color: pod.phase === "Failed" ? phaseColor.failed : color.fg }}>{pod.phase}</td>
            <td style={{ ...cell, fontSize: 12 }}>{pod.node || ""}</td>
            <td style={cell}>{pod.restarts ?? ""}</td>
            <td style={{ ...cell, fontSize: 12, maxWidth: 360 }}><Reason pod={pod} /></td>
            <td style={cell}>{pod.exit_code ?? ""}</td>
          </tr>
        ))}
      </tbody>
    </table>
  );
}

function LogTails({ pods }) {
  const withLogs = pods.filter((pod) => pod.log_tail);
  if (!withLogs.length) return null;
  return (
    <div>
      <h3 style={{ fontSize: 16, fontWeight: 600, margin: "16px 0 8px" }}>Log tails</h3>
      {withLogs.map((pod, i) => (
        <details key={pod.name} open={i === 0 || pod.phase === "Failed"} data-testid="log-tail" style={{ marginBottom: 8 }}>
          <summary style={{ cursor: "pointer" }}>{pod.name}</summary>
          <pre style={{ maxHeight: 260, overflow: "auto", fontSize: 12, padding: 8, background: color.subtle,
            border: `1px solid ${color.border}`, borderRadius: 4, whiteSpace: "pre-wrap" }}>{pod.log_tail}</pre>
        </details>
      ))}
    </div>
  );
}

// Rank 0's tensors, state dicts and Modules: where each is in the task's XCom, its size and its URL (kept in
// artifact storage; artifacts.load() in a downstream task reads them).
function Artifacts({ artifacts, omitted }) {
  if (!artifacts.length) return null;
  const total = artifacts.reduce((sum, a) => sum + (a.bytes || 0), 0);
  return (
    <div>
      <h3 style={{ fontSize: 16, fontWeight: 600, margin: "16px 0 8px" }}>
        Artifacts <span style={{ fontWeight: 400, color: color.muted, fontSize: 13 }} data-testid="artifacts-total">
          {artifacts.length}{omitted ? ` (+${omitted} not listed)` : ""}, {size(total)}
        </span>
      </h3>
      <table style={{ borderCollapse: "collapse", width: "100%" }} data-testid="artifacts-table">
        <thead>
          <tr>{["In the value", "Kind", "Size", "URL"].map((h) => <th key={h} style={head}>{h}</th>)}</tr>
        </thead>
        <tbody>
          {artifacts.map((a) => (
            <tr key={a.url} data-testid="artifact-row" data-kind={a.kind} data-bytes={a.bytes}>
              <td style={{ ...cell, fontFamily: "monospace", fontSize: 12 }}>{a.path || "(the value)"}</td>
              <td style={cell}>{a.kind}</td>
              <td style={{ ...cell, ...nowrap }}>{size(a.bytes)}</td>
              <td style={{ ...cell, fontSize: 12, wordBreak: "break-all" }}>{a.url}</td>
            </tr>
          ))}
        </tbody>
      </table>
    </div>
  );
}

export default function JobTab(props) {
  const { data, error, loading } = usePolling(
    () => loadJob(props),
    [props.dagId, props.runId, props.taskId, props.mapIndex],
    (d) => d.job !== null && isActive(d.job.phase),
  );
  if (loading) return <p style={{ padding: 16 }}>Loading…</p>;
  if (error && !data) return <div style={{ padding: 16 }}><ErrorLine error={error} /></div>;
  const job = data?.job;
  if (!job) {
    return (
      <p style={{ padding: 16, color: color.muted }} data-testid="no-training-job">
        No training job: this task instance did not run one (the tab shows jobs of @task.torch_elastic and
        TorchElasticOperator tasks, once they are submitted).
      </p>
    );
  }
  return (
    <div style={{ padding: 16, color: color.fg }} data-testid="training-job">
      <div style={{ display: "flex", gap: 16, alignItems: "baseline", flexWrap: "wrap", marginBottom: 12 }}>
        <PhaseBadge phase={job.phase} />
        <strong>{job.kind} {job.namespace}/{job.name}</strong>
        <span style={{ ...nowrap, color: color.muted }}>try {job.try_number ?? "?"}</span>
        <span style={nowrap}>pods running {job.pods_running}/{job.pods_total}</span>
        <span style={nowrap}>started {when(job.created)}</span>
        <span style={nowrap}>elapsed {elapsed(job.elapsed_seconds)}</span>
      </div>
      <ErrorLine error={error} />
      {job.root_cause && (
        <div data-testid="root-cause" style={{ border: `1px solid ${phaseColor.failed}`, borderRadius: 6, padding: 10, marginBottom: 12 }}>
          <strong style={{ color: phaseColor.failed }}>Root cause: </strong>
          <span style={{ whiteSpace: "pre-wrap" }}>{job.root_cause}</span>
        </div>
      )}
      {job.forensics && (
        <div data-testid="forensics" style={{ marginBottom: 12 }}>
          <strong>Stacks and traces: </strong>
          <code style={{ wordBreak: "break-all" }}>{job.forensics}</code>
        </div>
      )}
      <h3 style={{ fontSize: 16, fontWeight: 600, margin: "8px 0" }}>Metrics</h3>
      <Charts metrics={job.metrics} />
      <h3 style={{ fontSize: 16, fontWeight: 600, margin: "16px 0 8px" }}>Pods</h3>
      <Pods pods={job.pods || []} />
      <Artifacts artifacts={job.artifacts || []} omitted={job.artifacts_omitted || 0} />
      <LogTails pods={job.pods || []} />
    </div>
  );
}
