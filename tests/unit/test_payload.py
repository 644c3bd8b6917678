"""Payloads: the training function travels whole (closures, helpers, classes, sibling modules) and is refused with a
clear message where it cannot load."""

from __future__ import annotations

import importlib
import json
import shutil
import subprocess
import sys
import textwrap
import uuid
from pathlib import Path

import cloudpickle
import pytest

from airflow_provider_torchelastic.core.payload import (
    FORMAT_VERSION,
    MAGIC,
    PayloadError,
    dump_payload,
    load_payload,
    read_header,
)

HERE_PYTHON = f"{sys.version_info.major}.{sys.version_info.minor}"


def rewrite_header(payload: bytes, **changes: object) -> bytes:
    """The documented layout: MAGIC + one JSON header line + the pickled body."""
    assert payload.startswith(MAGIC)
    header_line, _, body = payload[len(MAGIC) :].partition(b"\n")
    header = json.loads(header_line)
    header.update(changes)
    return MAGIC + json.dumps(header).encode() + b"\n" + body


def make_adder(offset: int):
    scale = {"factor": 3}

    def add(x: int, *, extra: int = 0) -> int:
        return (x + offset + extra) * scale["factor"]

    return add


def test_closure_round_trip_with_args_and_kwargs() -> None:
    payload = load_payload(dump_payload(make_adder(10), (1,), {"extra": 2}))
    assert payload.args == (1,) and payload.kwargs == {"extra": 2}
    assert payload.fn(*payload.args, **payload.kwargs) == 39


def test_lambda_and_default_arguments() -> None:
    payload = load_payload(dump_payload(lambda a, b=5: a * b, [4]))
    assert payload.fn(*payload.args) == 20


def test_header_fields() -> None:
    data = dump_payload(make_adder(0))
    header, body = read_header(data)
    assert header.format == FORMAT_VERSION == 1
    assert header.python == HERE_PYTHON
    assert header.cloudpickle == cloudpickle.__version__
    # The header is readable without unpickling anything.
    assert data.startswith(MAGIC)
    raw = json.loads(data[len(MAGIC) :].split(b"\n", 1)[0])
    from airflow_provider_torchelastic import __version__

    assert header.provider == __version__
    assert raw == {"format": 1, "python": HERE_PYTHON, "cloudpickle": cloudpickle.__version__, "provider": __version__}
    assert cloudpickle.loads(body)["args"] == ()


def test_dump_refuses_a_non_callable() -> None:
    with pytest.raises(TypeError, match=r"python_callable: expected a callable, got 42"):
        dump_payload(42)  # type: ignore[arg-type]


MODULE_A = """
from {helper} import scale

OFFSET = 1


class Accumulator:
    def __init__(self, value):
        self.value = value

    def total(self):
        return self.value + OFFSET


def sibling(x):
    return x * 10


def train(x):
    return {{"value": scale(Accumulator(sibling(x)).total()), "module": __name__}}
"""

MODULE_B = """
FACTOR = 3


def scale(y):
    return y * FACTOR
"""

LOADER = """
import importlib.util, sys
from pathlib import Path
from airflow_provider_torchelastic.core.payload import load_payload

assert {folder!r} not in sys.path, sys.path
for name in ({a!r}, {b!r}):
    assert importlib.util.find_spec(name) is None, name
payload = load_payload(Path({path!r}).read_bytes())
print(payload.fn(*payload.args, **payload.kwargs)["value"])
"""


def test_function_from_a_module_that_does_not_exist_where_it_is_loaded(tmp_path: Path) -> None:
    folder = tmp_path / "dags"
    folder.mkdir()
    tag = uuid.uuid4().hex[:8]
    name_a, name_b = f"dag_file_{tag}", f"dag_helpers_{tag}"
    (folder / f"{name_a}.py").write_text(textwrap.dedent(MODULE_A.format(helper=name_b)))
    (folder / f"{name_b}.py").write_text(MODULE_B)
    sys.path.insert(0, str(folder))
    try:
        module = importlib.import_module(name_a)
        assert module.train(4) == {"value": 123, "module": name_a}
        data = dump_payload(module.train, (4,))
    finally:
        sys.path.remove(str(folder))
        sys.modules.pop(name_a, None)
        sys.modules.pop(name_b, None)
    # Registration for by-value pickling is process-global: dumping must leave none behind.
    assert name_a not in cloudpickle.list_registry_pickle_by_value()
    assert name_b not in cloudpickle.list_registry_pickle_by_value()
    shutil.rmtree(folder)
    path = tmp_path / "payload.bin"
    path.write_bytes(data)

    code = LOADER.format(folder=str(folder), a=name_a, b=name_b, path=str(path))
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120, check=False
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "123"


def test_python_minor_mismatch_names_both_versions() -> None:
    data = rewrite_header(dump_payload(make_adder(1)), python="3.99")
    with pytest.raises(PayloadError) as info:
        load_payload(data)
    message = str(info.value)
    assert "Python 3.99" in message and f"Python {HERE_PYTHON}" in message
    assert "image" in message, "the message should say how to fix it"


def test_unknown_format_is_refused() -> None:
    data = rewrite_header(dump_payload(make_adder(1)), format=FORMAT_VERSION + 1)
    with pytest.raises(PayloadError, match=rf"payload format {FORMAT_VERSION + 1} is not supported"):
        load_payload(data)


@pytest.mark.parametrize(
    ("data", "words"),
    [
        (b"\x80\x05garbage", "not a torch elastic payload"),
        (b"", "not a torch elastic payload"),
        (MAGIC + b'{"format": 1', "truncated payload"),
        (MAGIC + b"{not json}\n" + b"body", "unreadable payload header"),
        (MAGIC + b'{"format": 1}\n' + b"body", "unreadable payload header"),
    ],
    ids=["wrong-magic", "empty", "truncated-header", "bad-json", "missing-fields"],
)
def test_unusable_header_is_refused(data: bytes, words: str) -> None:
    with pytest.raises(PayloadError, match=words):
        load_payload(data)


@pytest.mark.parametrize("cut", [b"garbage", None], ids=["garbage-body", "truncated-body"])
def test_corrupt_body_is_a_payload_error(cut: bytes | None) -> None:
    data = dump_payload(make_adder(1))
    header_end = data.index(b"\n", len(MAGIC)) + 1
    body = data[header_end:]
    corrupt = data[:header_end] + (cut if cut is not None else body[: len(body) // 2])
    with pytest.raises(PayloadError, match="corrupt"):
        load_payload(corrupt)


FAILING_MODULE = """
def helper(x):
    return 1 / x


def train(x):
    y = x - x
    return helper(y)
"""

TRACEBACK_LOADER = """
import traceback
from pathlib import Path
from airflow_provider_torchelastic.core.payload import load_payload

payload = load_payload(Path({path!r}).read_bytes())
try:
    payload.fn(*payload.args)
except ZeroDivisionError:
    print(traceback.format_exc())
"""


def _dump_train_of(folder: Path, prefix: str, source: str) -> tuple[Path, bytes]:
    """Write ``source`` as a fresh module in ``folder``, import it, and dump its ``train(5)``: the module file and
    the payload (the module is forgotten again)."""
    folder.mkdir()
    name = f"{prefix}_{uuid.uuid4().hex[:8]}"
    source_file = folder / f"{name}.py"
    source_file.write_text(source)
    sys.path.insert(0, str(folder))
    try:
        return source_file, dump_payload(importlib.import_module(name).train, (5,))
    finally:
        sys.path.remove(str(folder))
        sys.modules.pop(name, None)


def test_worker_tracebacks_name_the_dag_file_and_show_its_lines(tmp_path: Path) -> None:
    # cloudpickle renames by-value code "<dynamic-code>"; the payload puts the file and its source back.
    folder = tmp_path / "dags"
    source_file, data = _dump_train_of(folder, "failing_dag", FAILING_MODULE)
    shutil.rmtree(folder)  # the worker has no DAG file: lines come from the payload
    path = tmp_path / "payload.bin"
    path.write_bytes(data)
    proc = subprocess.run(
        [sys.executable, "-c", TRACEBACK_LOADER.format(path=str(path))],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    assert f'File "{source_file}", line 8, in train' in proc.stdout
    assert "return helper(y)" in proc.stdout
    assert f'File "{source_file}", line 3, in helper' in proc.stdout and "return 1 / x" in proc.stdout
    assert "<dynamic-code>" not in proc.stdout


MODULE_WITH_A_SECRET = """
WAREHOUSE_PASSWORD = "hunter2-unrelated-credential"


def train(x):
    return x * 2
"""


def test_the_payload_carries_the_functions_lines_not_the_rest_of_the_module(tmp_path: Path) -> None:
    """Issue 20, item 1: a DAG file's unrelated top-level text (a credential beside the function) does not travel;
    the function's own lines do, at their line numbers, for tracebacks."""
    _, data = _dump_train_of(tmp_path / "dags", "secret_dag", MODULE_WITH_A_SECRET)
    assert b"hunter2-unrelated-credential" not in data
    assert b"WAREHOUSE_PASSWORD" not in data
    # The function's lines at their own line numbers (5 and 6): the lines before them are blank.
    assert b"\n\n\n\ndef train(x):\n    return x * 2\n" in data
