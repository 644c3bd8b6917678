"""The shipped code's module in the worker: DAG-file code behaves there as it does in the DAG file.

Code pickled by value still names its module, and Python looks modules up by name: ``dataclasses`` resolves string
annotations (``from __future__ import annotations``) in ``sys.modules[cls.__module__]``, so does
``typing.get_type_hints``, and ``pickle`` imports a class's module to find it. Each test writes a DAG-like module,
dumps a payload from it, deletes it, and loads the payload in a fresh interpreter where the module never existed.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import shutil
import subprocess
import sys
import textwrap
import uuid
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from enum import Enum
from fractions import Fraction
from pathlib import Path
from typing import Any, ClassVar, Optional

import cloudpickle
import pytest

from airflow_provider_torchelastic.core import payload as payload_module
from airflow_provider_torchelastic.core.payload import MAGIC, dump_payload, load_payload

# --- a DAG file, as the workers must see it ------------------------------------------------------------------------

DAG_MODULE = """
from __future__ import annotations

import dataclasses
import enum
import pickle
import sys
import typing
from dataclasses import InitVar, dataclass, field
from typing import ClassVar, Optional


class Split(enum.Enum):
    TRAIN = "train"
    EVAL = "eval"


@dataclass(frozen=True)
class Shard:
    index: int
    split: Split
    weight: Optional[float] = None
    opened: ClassVar[int] = 0


COUNTER = 0


def bump() -> int:
    global COUNTER
    COUNTER += 1
    return COUNTER


def hints(cls) -> dict:
    return {name: repr(value) for name, value in typing.get_type_hints(cls).items()}


def train(index: int) -> dict:
    class Mode(enum.Enum):
        FAST = 1
        SLOW = 2

    @dataclass
    class Batch:
        size: int
        shard: Shard
        scale: InitVar[float] = 1.0
        seen: ClassVar[int] = 0
        mode: Optional[enum.Enum] = None
        tags: list[str] = field(default_factory=list)

        def __post_init__(self, scale: float) -> None:
            self.size = int(self.size * scale)

    shard = Shard(index, Split.TRAIN)
    batch = Batch(4, shard, 2.0, mode=Mode.SLOW)
    module = sys.modules[__name__]
    return {
        "batch_fields": [f.name for f in dataclasses.fields(Batch)],
        "batch_size": batch.size,
        "batch_hints": hints(Batch),
        "shard_fields": [f.name for f in dataclasses.fields(Shard)],
        "shard_hints": hints(Shard),
        "train_hints": {name: repr(value) for name, value in typing.get_type_hints(train).items()},
        "asdict": repr(dataclasses.asdict(batch)),
        "module_is_globals": module.__dict__ is globals() and Batch.__module__ == __name__,
        "classes_by_name": module.Shard is Shard and module.Split is Split,
        "shard_round_trip": pickle.loads(pickle.dumps(shard)) == shard,
        "enum_round_trip": pickle.loads(pickle.dumps(Split.EVAL)) is Split.EVAL,
        "counter": [bump(), bump(), module.COUNTER],
    }
"""

LOADER_PRELUDE = """
import importlib.util, json, sys
from pathlib import Path
from airflow_provider_torchelastic.core.payload import load_payload

NAME = {name!r}
assert {folder!r} not in sys.path, sys.path
assert NAME not in sys.modules and importlib.util.find_spec(NAME.partition(".")[0]) is None, NAME
"""

LOAD = """
payload = load_payload(Path({path!r}).read_bytes())
fn = payload.fn
"""


@dataclass(frozen=True)
class DagFolder:
    """DAG-like modules written under a unique name, imported to dump a payload, then deleted."""

    root: Path
    tag: str

    @property
    def folder(self) -> Path:
        return self.root / "dags"

    def write(self, files: Mapping[str, str]) -> None:
        for relative, source in files.items():
            path = self.folder / relative.format(tag=self.tag)
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(textwrap.dedent(source.replace("{tag}", self.tag)))

    def dump(self, module: str, function: str, args: tuple = (), *, installed: tuple[Path, ...] = ()) -> Path:
        """Dump ``module.function`` from the folder; ``installed`` folders count as installed packages."""
        name = module.format(tag=self.tag)
        roots = payload_module._installed_roots
        with pytest.MonkeyPatch.context() as patch:
            patch.syspath_prepend(str(self.folder))
            patch.setattr(payload_module, "_installed_roots", lambda: (*roots(), *(p.resolve() for p in installed)))
            try:
                data = dump_payload(getattr(importlib.import_module(name), function), args)
            finally:
                for loaded in [m for m in sys.modules if m.split(".")[0].endswith(self.tag)]:
                    del sys.modules[loaded]
        path = self.root / f"{name}.payload"
        path.write_bytes(data)
        return path

    def load_and_run(
        self, name: str, path: Path, code: str, *, before: str = "", path_entries: tuple[Path, ...] = ()
    ) -> Any:
        """Load the payload in a fresh interpreter (after running ``before``), run ``code``: it prints one JSON
        document."""
        prelude = "".join(f"sys.path.insert(0, {str(p)!r})\n" for p in path_entries)
        script = (
            LOADER_PRELUDE.format(name=name.format(tag=self.tag), folder=str(self.folder))
            + prelude
            + textwrap.dedent(before)
            + LOAD.format(path=str(path))
            + textwrap.dedent(code)
        )
        proc = subprocess.run(
            [sys.executable, "-c", script], cwd=self.root, capture_output=True, text=True, timeout=120, check=False
        )
        assert proc.returncode == 0, proc.stderr
        return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture
def dags(tmp_path: Path) -> Iterator[DagFolder]:
    folder = DagFolder(tmp_path, uuid.uuid4().hex[:8])
    yield folder
    assert not [m for m in sys.modules if folder.tag in m], "a test left a DAG module behind"


REPORTED = """
from __future__ import annotations

from dataclasses import dataclass


def train():
    @dataclass
    class Point:
        x: int

    return repr(Point(1))
"""


def test_a_dataclass_declared_in_the_function_of_a_future_annotations_dag_file(dags: DagFolder) -> None:
    # The report: AttributeError: 'NoneType' object has no attribute '__dict__' inside dataclasses, on every worker.
    dags.write({"dag_{tag}.py": REPORTED})
    payload = dags.dump("dag_{tag}", "train")
    shutil.rmtree(dags.folder)
    assert dags.load_and_run("dag_{tag}", payload, "print(json.dumps(fn()))") == "train.<locals>.Point(x=1)"


def test_dag_file_code_behaves_in_the_worker_as_in_the_dag_file(dags: DagFolder) -> None:
    name = "dag_{tag}"
    dags.write({"dag_{tag}.py": DAG_MODULE})
    payload = dags.dump(name, "train", (3,))
    # What the DAG file itself computes, with the module imported as Airflow imports it.
    sys.path.insert(0, str(dags.folder))
    try:
        expected = importlib.import_module(name.format(tag=dags.tag)).train(3)
    finally:
        sys.path.remove(str(dags.folder))
        del sys.modules[name.format(tag=dags.tag)]
    shutil.rmtree(dags.folder)  # the worker has no DAG file

    got = dags.load_and_run(name, payload, "print(json.dumps(fn(*payload.args)))")

    # The counter starts again in each worker from the value shipped (0): the rest is the DAG file's behaviour.
    assert got == expected
    assert got["batch_fields"] == ["size", "shard", "mode", "tags"], "ClassVar and InitVar are no fields"
    assert got["batch_size"] == 8, "the InitVar reached __post_init__"
    assert got["shard_fields"] == ["index", "split", "weight"]
    tag = dags.tag
    assert got["shard_hints"] == {
        "index": "<class 'int'>",
        "split": "<enum 'Split'>",
        "weight": "typing.Optional[float]",
        "opened": "typing.ClassVar[int]",
    }
    assert got["batch_hints"]["shard"] == f"<class 'dag_{tag}.Shard'>"
    assert got["batch_hints"]["scale"] == "dataclasses.InitVar[float]"
    assert got["batch_hints"]["seen"] == "typing.ClassVar[int]"
    assert got["batch_hints"]["mode"] == "typing.Optional[enum.Enum]"
    assert got["train_hints"] == {"index": "<class 'int'>", "return": "<class 'dict'>"}
    assert got["module_is_globals"] and got["classes_by_name"]
    assert got["shard_round_trip"] and got["enum_round_trip"]
    assert got["counter"] == [1, 2, 2]


def test_the_module_is_registered_before_the_code_runs_and_shared_by_its_functions(dags: DagFolder) -> None:
    name = "dag_{tag}"
    dags.write({"dag_{tag}.py": DAG_MODULE})
    payload = dags.dump(name, "train", (1,))
    shutil.rmtree(dags.folder)
    got = dags.load_and_run(
        name,
        payload,
        """
        module = sys.modules[NAME]
        print(json.dumps({
            "module": isinstance(module, type(sys)),
            "is_globals": module.__dict__ is fn.__globals__,
            "helpers_share_it": module.hints.__globals__ is module.bump.__globals__ is module.__dict__,
            "file": module.__file__,
            "spec": module.__spec__.name,
            "origin_of_shard": module.Shard.__module__,
            # a second load of the same payload reuses the module cloudpickle's class tracking already ties it to
            "reused": load_payload(Path(PAYLOAD).read_bytes()).fn.__globals__ is module.__dict__,
            "not_a_whole_dag_module": sorted(k for k in vars(module) if not k.startswith("__")),
        }))
        """,
        before=f"PAYLOAD = {str(payload)!r}\n",
    )
    assert got["module"] and got["is_globals"] and got["helpers_share_it"] and got["reused"]
    assert got["file"] == str(dags.folder / f"dag_{dags.tag}.py")
    assert got["spec"] == got["origin_of_shard"] == f"dag_{dags.tag}"
    # The globals that travelled with the function (and the names its annotations need), not the whole file.
    assert got["not_a_whole_dag_module"] == [
        "COUNTER",
        "ClassVar",
        "InitVar",
        "Optional",
        "Shard",
        "Split",
        "bump",
        "dataclass",
        "dataclasses",
        "enum",
        "field",
        "hints",
        "pickle",
        "sys",
        "train",
        "typing",
    ]


SIMPLE_MODULE = """
def train(x):
    return {"value": x * 2, "module": __name__}
"""


@pytest.mark.parametrize("where", ["imported", "importable"])
def test_a_module_that_exists_in_the_worker_is_never_replaced(dags: DagFolder, tmp_path: Path, where: str) -> None:
    name = "dag_{tag}"
    dags.write({"dag_{tag}.py": SIMPLE_MODULE})
    payload = dags.dump(name, "train", (21,))
    shutil.rmtree(dags.folder)
    # The worker has a module of that name of its own (an installed package, say).
    installed = tmp_path / "site"
    installed.mkdir()
    (installed / f"dag_{dags.tag}.py").write_text("IMPORTED = True\n")
    own = "import types\nsys.modules[NAME] = own = types.ModuleType(NAME)\n" if where == "imported" else ""
    got = dags.load_and_run(
        name,
        payload,
        """
        result = fn(*payload.args)
        print(json.dumps({
            "result": result,
            "kept": sys.modules[NAME] is own if "own" in globals() else NAME not in sys.modules,
            "own_globals": fn.__globals__ is not getattr(sys.modules.get(NAME), "__dict__", None),
        }))
        """,
        before=own,
        path_entries=(installed,) if where == "importable" else (),
    )
    assert got["result"] == {"value": 42, "module": f"dag_{dags.tag}"}
    assert got["kept"], "the worker's own module was replaced, or imported for the payload"
    assert got["own_globals"]


PACKAGE_INIT = ""
PACKAGE_MODELS = """
from __future__ import annotations

import pickle
from dataclasses import dataclass


@dataclass
class Sample:
    features: list[float]
    label: int


def train() -> dict:
    import sys

    sample = Sample([1.0, 2.0], 1)
    return {
        "round_trip": pickle.loads(pickle.dumps(sample)) == sample,
        "parent_is_package": sys.modules["pkg_{tag}"].__path__ == [],
        "child_attribute": sys.modules["pkg_{tag}"].models is sys.modules[__name__],
    }
"""


def test_a_module_of_a_package_that_does_not_exist_in_the_worker(dags: DagFolder) -> None:
    dags.write({"pkg_{tag}/__init__.py": PACKAGE_INIT, "pkg_{tag}/models.py": PACKAGE_MODELS})
    payload = dags.dump("pkg_{tag}.models", "train")
    shutil.rmtree(dags.folder)
    got = dags.load_and_run("pkg_{tag}.models", payload, "print(json.dumps(fn()))")
    assert got == {"round_trip": True, "parent_is_package": True, "child_attribute": True}


ANNOTATION_MODULE = """
from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass
from fractions import Fraction

from heavy_{tag} import Heavy


def train() -> dict:
    @dataclass
    class Weighted:
        value: Fraction
        model: Heavy | None = None

    return {"fields": [f.name for f in dataclasses.fields(Weighted)]}
"""

HEAVY_MODULE = """
class Heavy:
    pass
"""


def test_annotation_names_load_without_importing_anything_new(dags: DagFolder, tmp_path: Path) -> None:
    # Heavy comes from an "installed" package that the worker has (importable) but has not imported: an annotation
    # must not import it (think of Airflow in a local worker). Fraction is standard library: it is resolved.
    installed = tmp_path / "site"
    dags.write({"dag_{tag}.py": ANNOTATION_MODULE})
    installed.mkdir()
    (installed / f"heavy_{dags.tag}.py").write_text(HEAVY_MODULE)
    sys.path.insert(0, str(installed))
    try:
        payload = dags.dump("dag_{tag}", "train", installed=(installed,))
    finally:
        sys.path.remove(str(installed))
    shutil.rmtree(dags.folder)
    got = dags.load_and_run(
        "dag_{tag}",
        payload,
        """
        module = sys.modules[NAME]
        print(json.dumps({
            "result": fn(),
            "fraction": module.Fraction.__module__,
            "heavy": "Heavy" in vars(module),
            "imported": [m for m in sys.modules if m.startswith("heavy_")],
        }))
        """,
        path_entries=(installed,),
    )
    assert got == {"result": {"fields": ["value", "model"]}, "fraction": "fractions", "heavy": False, "imported": []}


MISSING_MODULE = """
from helper_{tag} import scale


def train(x):
    return scale(x)
"""


def test_a_failed_load_leaves_no_module_behind(dags: DagFolder, tmp_path: Path) -> None:
    installed = tmp_path / "site"
    installed.mkdir()
    (installed / f"helper_{dags.tag}.py").write_text("def scale(x):\n    return x * 2\n")
    dags.write({"dag_{tag}.py": MISSING_MODULE})
    sys.path.insert(0, str(installed))
    try:
        # helper_ counts as installed: pickled by reference, it is missing where the payload loads.
        payload = dags.dump("dag_{tag}", "train", (1,), installed=(installed,))
    finally:
        sys.path.remove(str(installed))
    shutil.rmtree(dags.folder)
    script = (
        LOADER_PRELUDE.format(name=f"dag_{dags.tag}", folder=str(dags.folder))
        + f"""
try:
    load_payload(Path({str(payload)!r}).read_bytes())
except ModuleNotFoundError as e:
    print(json.dumps({{"error": str(e), "left": [m for m in sys.modules if {dags.tag!r} in m]}}))
"""
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout) == {"error": f"No module named 'helper_{dags.tag}'", "left": []}


# --- in process: what the payload carries ------------------------------------------------------------------------


class Split(Enum):
    TRAIN = 1


@dataclass
class Record:
    split: Split
    ratio: Fraction


def uses_names_only_in_annotations() -> type:
    @dataclass
    class Local:
        record: Record
        count: ClassVar[int] = 0
        split: Optional[Split] = None  # noqa: UP045 (typing's Optional must be found too)
        tags: list[str] = dataclasses.field(default_factory=list)
        scale: float = DEFAULT_SCALE

    return Local


DEFAULT_SCALE = 0.5


def test_globals_that_cloudpickle_leaves_behind_travel_apart() -> None:
    local = payload_module._local_code(uses_names_only_in_annotations, (), {})
    # `dataclass` is read by the function's code: cloudpickle ships it. The class body reads `dataclasses` and
    # `DEFAULT_SCALE` (needed); the annotations name the rest, Fraction through Record's own annotations.
    assert local.extra_globals == {
        __name__: {
            "ClassVar": (ClassVar, False),
            "DEFAULT_SCALE": (DEFAULT_SCALE, True),
            "Fraction": (Fraction, False),
            "Optional": (Optional, False),
            "Record": (Record, False),
            "Split": (Split, False),
            "dataclasses": (dataclasses, True),
        }
    }


def test_a_module_that_exists_here_gets_the_left_behind_globals_in_its_functions_namespace() -> None:
    # This test module exists where the payload loads: it is not replaced, and the class body's globals go to the
    # namespace that cloudpickle gives its functions.
    fn = load_payload(dump_payload(uses_names_only_in_annotations)).fn
    assert fn.__globals__ is not globals() and sys.modules[__name__].__dict__ is globals()
    local = fn()
    assert [f.name for f in dataclasses.fields(local)] == ["record", "split", "tags", "scale"]
    assert local(Record(Split.TRAIN, Fraction(1, 2))).scale == 0.5


def plain_dataclass() -> list[str]:
    @dataclass
    class Point:
        x: int
        y: ClassVar[int] = 0

    return [f.name for f in dataclasses.fields(Point)]


def test_a_payload_without_extra_globals_still_loads() -> None:
    # A payload written before those globals travelled: its body has no "extra_globals".
    data = dump_payload(plain_dataclass)
    header_end = data.index(b"\n", len(MAGIC)) + 1
    body = cloudpickle.loads(data[header_end:])
    del body["extra_globals"]
    old = data[:header_end] + cloudpickle.dumps(body)
    assert load_payload(old).fn() == ["x"]
