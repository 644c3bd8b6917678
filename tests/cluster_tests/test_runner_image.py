"""The runner image built from docker/Dockerfile (tests/cluster/image.py), and the pure pieces that decide how.

The image tests run the built images with ``buildah run`` in the builder's own storage (no registry, no network):
the runner's entrypoint, that Airflow is not importable there, torch's CPU build, and the alpine stand-in's tools.
They run when ``TORCHELASTIC_NODE=real`` (building the images first, cold if need be) or when the images were built
before (``python -m tests.cluster.image``); otherwise they skip, so that a plain test run never starts a cold build.
"""

from __future__ import annotations

import json
import os
import subprocess
import tarfile
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest

from tests.cluster import image

NODE_ENV = "TORCHELASTIC_NODE"

# One pytest worker runs the whole module, in order: the last test checks that no working container is left, which
# another worker's test holding one (buildah from ... rm) would make fail at random.
pytestmark = pytest.mark.xdist_group("runner-image")


# --- pure pieces ----------------------------------------------------------------------------------------------------

PIP_CONFIG_LIST = """\
:env:.cert='/etc/ssl/certs/ca-certificates.crt'
:env:.find-links='/opt/wheels'
global.cert='/etc/ssl/certs/ca-certificates.crt'
global.constraint='/etc/xdg/pip/constraints.txt'
global.extra-index-url='file:///opt/pypi/simple file:///opt/pypi-more/simple'
global.find-links='/somewhere/else'
"""


def test_pip_config_list_is_read_with_a_variable_over_install_over_global() -> None:
    items = image.parse_pip_config_list(PIP_CONFIG_LIST + "install.index-url='https://mirror.example/simple'\n")
    assert items[":env:.find-links"] == "/opt/wheels"
    assert items["global.extra-index-url"] == "file:///opt/pypi/simple file:///opt/pypi-more/simple"
    sources = image.pip_sources_to_build(items, exists=lambda path: True)
    assert sources.build_args == {
        "TORCH_INDEX_URL": "",
        "PIP_INDEX_URL": "https://mirror.example/simple",
        "PIP_EXTRA_INDEX_URL": "file:///opt/pypi/simple file:///opt/pypi-more/simple",
        "PIP_FIND_LINKS": "/opt/wheels",
        "PIP_CERT": "/etc/ssl/certs/ca-certificates.crt",
    }


def test_local_indexes_are_mounted_from_their_parent_and_find_links_as_they_are() -> None:
    sources = image.pip_sources_to_build(image.parse_pip_config_list(PIP_CONFIG_LIST), exists=lambda path: True)
    # /opt/pypi: a PEP 503 tree links its wheels as ../../files/... from simple/<name>/.
    assert sources.mounts == ("/etc/ssl/certs/ca-certificates.crt", "/opt/pypi", "/opt/pypi-more", "/opt/wheels")


def test_remote_sources_need_no_mount_and_missing_paths_are_not_mounted() -> None:
    items = {
        "global.index-url": "https://mirror.example/simple",
        "global.find-links": "https://wheels.example/torch.html /gone file:///opt/wheels/",
    }
    sources = image.pip_sources_to_build(items, exists=lambda path: path == "/opt/wheels")
    assert sources.mounts == ("/opt/wheels",)
    assert sources.build_args["PIP_FIND_LINKS"] == "https://wheels.example/torch.html /gone file:///opt/wheels/"


def test_no_pip_configuration_gives_only_the_empty_torch_index() -> None:
    assert image.pip_sources_to_build({}) == image.PipSources(build_args={"TORCH_INDEX_URL": ""}, mounts=())


def test_debian_mirrors_come_from_the_hosts_sources_for_bookworm_whatever_the_host_runs() -> None:
    deb822 = """\
Types: deb
# a comment
URIs: http://mirror.example/debian/
Suites: trixie trixie-updates
Components: main

Types: deb-src
URIs: http://src.example/debian

Types: deb
URIs: http://mirror.example/debian-security
Suites: trixie-security
Components: main
"""
    assert image.debian_mirrors(deb822) == [
        "deb http://mirror.example/debian bookworm main",
        "deb http://mirror.example/debian bookworm-updates main",
        "deb http://mirror.example/debian-security bookworm-security main",
    ]
    assert image.debian_mirrors("deb [arch=amd64] http://one.example/debian bookworm main\n")[0] == (
        "deb http://one.example/debian bookworm main"
    )
    assert image.debian_mirrors("") == [
        f"deb {image.DEBIAN_FALLBACK_MIRROR} bookworm main",
        f"deb {image.DEBIAN_FALLBACK_MIRROR} bookworm-updates main",
    ]


def test_the_context_fingerprint_follows_the_code_and_ignores_bytecode(tmp_path: Path) -> None:
    for name in ("pyproject.toml", "README.md", "build_ui.py"):
        (tmp_path / name).write_text(name)
    package = tmp_path / "airflow_provider_torchelastic"
    (package / "__pycache__").mkdir(parents=True)
    (package / "runner.py").write_text("x = 1\n")
    (tmp_path / "tests").mkdir()
    before = image.context_fingerprint(tmp_path)
    (package / "__pycache__" / "runner.cpython-311.pyc").write_bytes(b"\0")
    (tmp_path / "tests" / "test_x.py").write_text("not copied\n")
    assert image.context_fingerprint(tmp_path) == before
    (package / "runner.py").write_text("x = 2\n")
    assert image.context_fingerprint(tmp_path) != before


def test_the_alpine_tree_links_every_applet_to_busybox(tmp_path: Path) -> None:
    busybox = tmp_path / "busybox"
    busybox.write_bytes(b"\x7fELF")
    image.alpine_tree(busybox, ["busybox", "sh", "seq", "nslookup", "sleep"], tmp_path / "tree.tar")
    with tarfile.open(tmp_path / "tree.tar") as tar:
        members = {m.name: m for m in tar.getmembers()}
    assert members["bin/busybox"].mode == 0o755
    assert {n for n, m in members.items() if m.issym()} == {"bin/sh", "bin/seq", "bin/sleep"}
    assert members["bin/sh"].linkname == "/bin/busybox"
    assert members["bin/nslookup"].isfile() and members["bin/nslookup"].mode == 0o755  # the wrapper script
    assert members["tmp"].mode == 0o1777


def test_the_dockerfiles_pip_sources_have_no_defaults_and_reach_every_pip_step() -> None:
    text = image.DOCKERFILE.read_text()
    for name in ("PIP_INDEX_URL", "PIP_EXTRA_INDEX_URL", "PIP_FIND_LINKS", "PIP_CERT"):
        assert f"\nARG {name}\n" in text, f"ARG {name} without a default: unset unless given"
    runs = [block for block in text.split("\nRUN ")[1:] if "pip install" in block]
    assert len(runs) == 4  # torch and cloudpickle, STORAGE=1's, FRAMEWORKS=1's, the package
    for block in runs:
        assert block.startswith('[ -n "${PIP_INDEX_URL}" ] || unset PIP_INDEX_URL;'), block


def test_the_dockerfiles_pip_guard_unsets_only_an_empty_index() -> None:
    guard = '[ -n "${PIP_INDEX_URL}" ] || unset PIP_INDEX_URL; echo "${PIP_INDEX_URL-unset}"'
    env = {"PATH": os.environ["PATH"]}
    empty = subprocess.run(["sh", "-c", guard], env={**env, "PIP_INDEX_URL": ""}, capture_output=True, text=True)
    given = subprocess.run(["sh", "-c", guard], env={**env, "PIP_INDEX_URL": "u"}, capture_output=True, text=True)
    assert (empty.stdout, given.stdout) == ("unset\n", "u\n")


def test_the_module_prints_the_reference_pods_use(capsys: pytest.CaptureFixture[str]) -> None:
    assert image.main(["--no-build"]) == 0
    assert image.main(["--no-build", "--storage"]) == 0
    assert capsys.readouterr().out.splitlines() == [image.RUNNER_REF, image.RUNNER_STORAGE_REF]
    assert image.runner_image_ref() == image.RUNNER_REF


# --- the built images -----------------------------------------------------------------------------------------------


def _built_before() -> bool:
    manifest = image.read_manifest()
    return {"runner.oci.tar", "alpine.oci.tar"} <= manifest.keys() and all(
        (image.images_dir() / name).is_file() for name in manifest
    )


@pytest.fixture(scope="module")
def images() -> Iterator[dict[str, dict[str, str]]]:
    if os.environ.get(NODE_ENV) != "real" and not _built_before():
        pytest.skip(
            f"runner image not built: set {NODE_ENV}=real to build it (about ten minutes cold), "
            "or run python -m tests.cluster.image"
        )
    # buildah run and rm write the machine-wide blob-info cache too.
    with image.no_machine_traces():
        yield image.ensure_images()


class Container:
    """A buildah working container of an image, in the builder's storage; removed on exit."""

    def __init__(self, ref: str) -> None:
        self.buildah = image.default_buildah()
        self.name = self.buildah.output("from", "--pull=never", ref).strip()

    def run(self, argv: Sequence[str]) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            self.buildah.argv("run", "--isolation", "chroot", self.name, "--", *argv),
            env=self.buildah.env,
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )

    def remove(self) -> None:
        self.buildah.output("rm", self.name)


@pytest.fixture
def runner(images: dict[str, dict[str, str]]) -> Iterator[Container]:
    container = Container(image.runner_image_ref())
    yield container
    container.remove()


def _config(ref: str) -> dict[str, object]:
    info = json.loads(image.default_buildah().output("inspect", "--type", "image", ref))
    config: dict[str, object] = info["OCIv1"]["config"]
    return config


def test_the_runner_images_entrypoint_is_the_runner(runner: Container) -> None:
    entrypoint = _config(image.runner_image_ref())["Entrypoint"]
    assert entrypoint == ["python", "-m", "airflow_provider_torchelastic.runner"]
    proc = runner.run(["python", "-m", "airflow_provider_torchelastic.runner", "--help"])
    assert proc.returncode == 0, proc.stderr
    assert "usage: python -m airflow_provider_torchelastic.runner" in proc.stdout


def test_airflow_and_the_kubernetes_client_are_not_importable_in_the_runner_image(runner: Container) -> None:
    for module in ("airflow", "kubernetes"):
        proc = runner.run(["python", "-c", f"import {module}"])
        assert proc.returncode != 0, f"{module} is importable in the runner image"
        assert f"No module named '{module}'" in proc.stderr


def test_the_runner_image_has_the_cpu_build_of_torch(runner: Container) -> None:
    proc = runner.run(["python", "-c", "import sys, torch; print(torch.__version__, torch.version.cuda, sys.version)"])
    assert proc.returncode == 0, proc.stderr
    version, cuda, python = proc.stdout.split(maxsplit=2)
    assert (version, cuda) == ("2.13.0+cpu", "None")
    assert python.startswith("3.11."), "the payload needs the Airflow side's Python minor"
    assert runner.run(["sh", "-c", "command -v torchrun"]).returncode == 0


def test_the_storage_variant_has_the_storage_file_systems(images: dict[str, dict[str, str]]) -> None:
    if "runner-storage.oci.tar" not in images:
        pytest.skip("the STORAGE=1 variant was not built")
    container = Container(image.runner_image_ref(storage=True))
    try:
        proc = container.run(["python", "-c", "import s3fs, gcsfs, adlfs, torch, airflow_provider_torchelastic.runner"])
    finally:
        container.remove()
    assert proc.returncode == 0, proc.stderr


def test_the_alpine_stand_in_has_what_init_pytorch_runs(images: dict[str, dict[str, str]]) -> None:
    container = Container(image.ALPINE_REF)
    try:
        # The shape of the training operator's init-pytorch command, without the name lookup (no DNS here).
        proc = container.run(["sh", "-c", "which nslookup sleep; for i in $(seq 3); do echo $i; sleep 0; done"])
    finally:
        container.remove()
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["/bin/nslookup", "/bin/sleep", "1", "2", "3"]


def test_each_archive_names_its_image_for_containerd(images: dict[str, dict[str, str]]) -> None:
    archives = image.image_archives()
    assert set(archives.values()) >= {image.RUNNER_REF, image.ALPINE_REF}
    for archive, ref in archives.items():
        with tarfile.open(archive) as tar:
            names = set(tar.getnames())
            index = json.load(tar.extractfile("index.json"))  # type: ignore[arg-type]
            (entry,) = index["manifests"]
            assert entry["annotations"][image.CONTAINERD_NAME_ANNOTATION] == ref
            algorithm, _, digest = entry["digest"].partition(":")
            manifest = json.load(tar.extractfile(f"blobs/{algorithm}/{digest}"))  # type: ignore[arg-type]
        for blob in [manifest["config"], *manifest["layers"]]:
            assert "blobs/{}/{}".format(*blob["digest"].split(":")) in names


def test_the_builder_left_no_container_and_no_mount(images: dict[str, dict[str, str]]) -> None:
    buildah = image.default_buildah()
    assert buildah.output("containers", "--quiet") == ""
    mounts = Path("/proc/mounts").read_text()
    assert str(buildah.root) not in mounts
