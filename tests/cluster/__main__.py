"""``python -m tests.cluster up|down|status|runner-image [--state-dir DIR]``.

``up`` prints progress on stderr and the admin kubeconfig path as the last line of stdout, so that
``kubectl --kubeconfig "$(python -m tests.cluster up | tail -1)" get pytorchjobs -A`` works. ``runner-image``
builds the runner image from docker/Dockerfile (tests/cluster/image.py; cached) and prints the reference pods on a
real node should use.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from tests.cluster import control_plane as cp
from tests.cluster import real_node


def _log(msg: str) -> None:
    print(f"[cluster] {msg}", file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.cluster", description=__doc__.splitlines()[0])
    parser.add_argument("command", choices=("up", "down", "status", "runner-image"))
    parser.add_argument(
        "--state-dir",
        type=Path,
        default=None,
        help=f"where the cluster keeps its data, logs and kubeconfigs (default: ${cp.DEFAULT_STATE_DIR_ENV} "
        f"or {cp.DEFAULT_STATE_DIR})",
    )
    parser.add_argument(
        "--audit-log",
        type=Path,
        default=None,
        help="up: have the kube-apiserver write an audit log (JSON lines, one per request) to this path",
    )
    parser.add_argument(
        "--node",
        choices=("sim", "real"),
        default=None,
        help="up: `sim` (the default), the simulated kubelet; `real`, a real kubelet, scheduler, controller-manager "
        "and containerd (tests/cluster/real_node.py; cgroup v1, root). Default: $TORCHELASTIC_NODE or sim",
    )
    args = parser.parse_args(argv)
    if args.command == "runner-image":
        from tests.cluster import image

        return image.main([])
    state_dir = (args.state_dir or cp.default_state_dir()).resolve()

    if args.command == "up":
        if cp.is_up(state_dir):
            info = cp.load_info(state_dir)
            assert info is not None  # is_up() read it
            _log(f"already up in {state_dir} ({info.api_url})")
            print(info.kubeconfig)
            return 0
        try:
            info = cp.ControlPlane(
                state_dir,
                log=_log,
                show_build_output=True,
                audit_log=args.audit_log,
                node=real_node.node_mode(args.node),
            ).start()
        except cp.ClusterError as e:
            _log(f"ERROR: {e}")
            return 1
        _log(
            f"up: {info.api_url}; state in {state_dir}; "
            f"stop with `python -m tests.cluster down --state-dir {state_dir}`"
        )
        _log(f"airflow service-account kubeconfig: {info.sa_kubeconfig}")
        print(info.kubeconfig)
        return 0

    if args.command == "down":
        survivors = cp.stop_cluster(state_dir, log=_log)
        if survivors:
            _log("ERROR: still running: " + ", ".join(survivors))
            return 1
        (state_dir / "state.json").unlink(missing_ok=True)
        _log(f"down ({state_dir})")
        return 0

    # status
    if cp.is_up(state_dir):
        info = cp.load_info(state_dir)
        assert info is not None
        alive = [f"{r.name}={r.pid}" for r in cp.read_pids(state_dir) if r.process() is not None]
        _log(f"up: {info.api_url}; processes: {' '.join(alive)}")
        print(info.kubeconfig)
        return 0
    _log(f"not running ({state_dir})")
    return 3


if __name__ == "__main__":
    sys.exit(main())
