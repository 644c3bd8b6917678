"""``python -m tests.airflow_services up|down|status|install-postgres [--state-dir DIR] [--kubeconfig PATH]``.

``up`` prints progress on stderr and the API's base URL as the last line of stdout. Without ``--kubeconfig`` it
starts a local test cluster of its own (``tests.cluster``, in ``<state dir>/cluster``), which ``down`` stops again.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from tests.airflow_services import deployment as dep
from tests.airflow_services import postgres


def _log(msg: str) -> None:
    print(f"[airflow] {msg}", file=sys.stderr, flush=True)


def _start_cluster(cluster_dir: Path) -> Path:
    from tests.cluster import control_plane as cp

    if cp.is_up(cluster_dir):
        info = cp.load_info(cluster_dir)
        assert info is not None  # is_up() read it
        _log(f"reusing the local cluster in {cluster_dir}")
        return info.kubeconfig
    _log(f"starting a local cluster in {cluster_dir}")
    return (
        cp.ControlPlane(cluster_dir, log=lambda m: print(f"[cluster] {m}", file=sys.stderr, flush=True))
        .start()
        .kubeconfig
    )


def _stop_cluster(cluster_dir: Path) -> list[str]:
    from tests.cluster import control_plane as cp

    survivors = cp.stop_cluster(cluster_dir, log=lambda m: print(f"[cluster] {m}", file=sys.stderr, flush=True))
    if not survivors:
        (cluster_dir / "state.json").unlink(missing_ok=True)
    return survivors


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.airflow_services", description=__doc__.splitlines()[0])
    parser.add_argument("command", choices=("up", "down", "status", "install-postgres"))
    parser.add_argument(
        "--state-dir",
        type=Path,
        default=None,
        help=f"where the deployment keeps its home, logs and state (default: ${dep.DEFAULT_STATE_DIR_ENV} or "
        f"{dep.DEFAULT_STATE_DIR})",
    )
    parser.add_argument("--kubeconfig", type=Path, help="a running cluster's kubeconfig (default: start one)")
    parser.add_argument("--namespace", default="torchelastic-test", help="the namespace of kubernetes_default")
    args = parser.parse_args(argv)
    state_dir = (args.state_dir or dep.default_state_dir()).resolve()

    if args.command == "install-postgres":
        try:
            _log(f"PostgreSQL: {postgres.ensure_installed(_log, state_dir / 'logs' / 'apt-get.log')}")
        except postgres.PostgresError as e:
            _log(f"ERROR: {e}")
            return 1
        return 0

    if args.command == "up":
        if dep.is_up(state_dir):
            info = dep.load_info(state_dir)
            assert info is not None  # is_up() read it
            _log(f"already up in {state_dir}")
            print(info.base_url)
            return 0
        cluster_dir = None
        try:
            if args.kubeconfig is not None:
                kubeconfig = args.kubeconfig
            else:
                cluster_dir = state_dir / "cluster"
                kubeconfig = _start_cluster(cluster_dir)
            info = dep.Deployment(state_dir, log=_log).start(
                kubeconfig=kubeconfig, namespace=args.namespace, cluster_dir=cluster_dir
            )
        except Exception as e:  # a failed start has stopped what it started; the cluster too
            _log(f"ERROR: {type(e).__name__}: {e}")
            if cluster_dir is not None:
                _stop_cluster(cluster_dir)
            return 1
        _log(f"user {info.username!r}, password {info.password!r}; logs in {state_dir / 'logs'}")
        _log(f"stop with `python -m tests.airflow_services down --state-dir {state_dir}`")
        print(info.base_url)
        return 0

    if args.command == "down":
        info = dep.load_info(state_dir)
        survivors = dep.stop_deployment(state_dir, log=_log)
        cluster_dir = info.cluster_dir if info is not None else None
        if cluster_dir is None and (state_dir / "cluster" / "pids.json").exists():
            cluster_dir = state_dir / "cluster"  # a cluster of a crashed `up` that never wrote state.json
        if cluster_dir is not None:
            survivors += _stop_cluster(cluster_dir)
        if survivors:
            _log("ERROR: still running: " + ", ".join(survivors))
            return 1
        (state_dir / "state.json").unlink(missing_ok=True)
        _log(f"down ({state_dir})")
        return 0

    # status
    if dep.is_up(state_dir):
        info = dep.load_info(state_dir)
        assert info is not None
        alive = [f"{r.name}={r.pid}" for r in dep.read_pids(state_dir) if r.process() is not None]
        _log(f"up: {info.base_url}; processes: {' '.join(alive)}")
        print(info.base_url)
        return 0
    _log(f"not running ({state_dir})")
    return 3


if __name__ == "__main__":
    sys.exit(main())
