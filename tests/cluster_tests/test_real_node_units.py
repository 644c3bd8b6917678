"""The real node's pure parts (tests/cluster/real_node.py), without starting anything: derived names, the refusal
of a cgroup v2 host, the rendered configs, and the hand-made OCI archives. The node itself: test_real_node.py."""

from __future__ import annotations

import ipaddress
import json
import tarfile
from pathlib import Path

import pytest

from tests.cluster import real_node as rn


def test_layout_is_derived_from_the_state_dir() -> None:
    a, b = rn.derive_layout(Path("/tmp/cluster-a")), rn.derive_layout(Path("/tmp/cluster-b"))
    assert a == rn.derive_layout(Path("/tmp/cluster-a"))  # stable
    assert len({a.key, b.key}) == 2 and a.subnet != b.subnet
    for layout in (a, b):
        assert len(layout.bridge) <= 15  # IFNAMSIZ - 1
        assert layout.node_name == f"te-{layout.key}" and layout.cgroup == f"torchelastic-{layout.key}"
        net = ipaddress.IPv4Network(layout.subnet)
        assert net.prefixlen == 24 and net.subnet_of(ipaddress.IPv4Network("10.192.0.0/10"))
        assert layout.gateway == str(net[1])
    assert rn.NodeLayout.from_json(json.loads(json.dumps(a.to_json()))) == a


def test_subnet_moves_off_a_taken_network() -> None:
    first = rn.derive_layout(Path("/tmp/cluster-a"))
    taken = ipaddress.IPv4Network(first.subnet)
    moved = rn.derive_layout(Path("/tmp/cluster-a"), [taken])
    assert not ipaddress.ip_network(moved.subnet).overlaps(taken)


def test_a_cgroup_v2_host_is_refused_loudly(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "cgroup.controllers").write_text("cpu memory pids\n")
    monkeypatch.setattr(rn, "CGROUP_ROOT", tmp_path)
    with pytest.raises(rn.NodeError, match=r"cgroup v2 .* needs cgroup v1"):
        rn.check_cgroup_v1()


def test_containerd_config_keeps_everything_under_the_node_dir() -> None:
    layout = rn.derive_layout(Path("/tmp/cluster-a"))
    config = rn.containerd_config(layout)
    for line in (
        f'root = "{layout.containerd_dir / "root"}"',
        f'state = "{layout.containerd_dir / "state"}"',
        "restrict_oom_score_adj = true",
        "SystemdCgroup = false",
        f'sandbox_image = "{rn.PAUSE_IMAGE}"',
        f'conf_dir = "{layout.node_dir / "cni" / "net.d"}"',
        f'Root = "{layout.containerd_dir / "runc"}"',
        '"io.containerd.internal.v1.opt"',
    ):
        assert line in config
    ipam = rn.cni_config(layout)["plugins"][0]["ipam"]
    assert ipam["dataDir"].startswith(str(layout.node_dir))
    assert rn.cni_config(layout)["plugins"][0]["ipMasq"] is False  # no iptables


def test_kubelet_flags() -> None:
    layout = rn.derive_layout(Path("/tmp/cluster-a"))
    args = rn.kubelet_args(layout, Path("/bin"))
    for flag in (
        "--make-iptables-util-chains=false",
        "--cgroup-driver=cgroupfs",
        "--fail-swap-on=false",
        "--anonymous-auth=false",
        "--image-gc-high-threshold=100",
        f"--node-ip={layout.gateway}",
        f"--cluster-dns={layout.gateway}",
        f"--cgroup-root=/{layout.cgroup}",
    ):
        assert flag in args
    assert any(a.startswith("--client-ca-file=") for a in args)
    assert any(a.startswith("--resolv-conf=") for a in args)


def test_oci_archive_names_its_image(tmp_path: Path) -> None:
    binary = tmp_path / "pause"
    binary.write_bytes(b"\x7fELF not really")
    archive = rn.write_oci_archive(
        tmp_path / "pause.oci.tar", rn.PAUSE_IMAGE, {"/pause": binary}, entrypoint=["/pause"]
    )
    images = rn.archive_images(archive)
    assert list(images) == [rn.PAUSE_IMAGE] and images[rn.PAUSE_IMAGE].startswith("sha256:")
    with tarfile.open(archive) as tar:
        names = tar.getnames()
        digest = images[rn.PAUSE_IMAGE].split(":", 1)[1]
        assert {"oci-layout", "index.json", f"blobs/sha256/{digest}"} <= set(names)
    assert rn.archive_images(tmp_path / "missing.oci.tar") == {}


def test_a_dead_holders_claims_are_given_back(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # CI once snapshotted a host that a SIGKILLed node (the machine restarted mid-run) still held: the dead holder's
    # sysctls and dirs were "before", and our own `down`, restoring the originals, looked like it took too much away.
    registry, made = tmp_path / "registry", tmp_path / "var" / "lib" / "kubelet"
    made.mkdir(parents=True)
    registry.mkdir()
    dead_state = tmp_path / "dead-cluster"  # no pid records: not alive
    (registry / "registry.json").write_text(
        json.dumps({"sysctls": {"kernel.panic": "0"}, "created_dirs": [str(made)], "holders": [str(dead_state)]})
    )
    written: dict[str, str] = {}
    monkeypatch.setattr(rn, "REGISTRY_DIR", registry)
    monkeypatch.setattr(rn, "write_sysctl", written.__setitem__)
    assert rn.live_holders() == []
    assert rn.reclaim_host() == [str(dead_state)]
    assert written == {"kernel.panic": "0"} and not made.exists() and not registry.exists()
    assert rn.reclaim_host() == []  # nothing left to give back
