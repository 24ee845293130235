"""The shape of the house: the scheduler core stays pure, every import goes through
the one `flagstop` package, no room's imports lead back to it, the wheel installs
nothing else, and the enums that cross the wire agree with the core's."""

import ast
import graphlib
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from flagstop.router.routing import BOTH, DECODE, PREFILL
from flagstop.scheduler_svc.core.request import FinishReason
from flagstop.v1 import generation_pb2, scheduler_pb2

ROOT = Path(__file__).resolve().parents[1]
CORE = ROOT / "scheduler_svc" / "core"
FORBIDDEN_IN_CORE = ("grpc", "google.protobuf", "torch", "asyncio", "flagstop")
ALLOWED_FLAGSTOP_IN_CORE = ("flagstop.scheduler_svc.core", "flagstop.utils")
FOLDER_NAMES = ("router", "scheduler_svc", "executor", "kernels")


def imported_modules(path: Path) -> list[str]:
    names = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.append(node.module)
    return names


def under(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


@pytest.mark.parametrize("path", sorted(CORE.glob("*.py")), ids=lambda p: p.name)
def test_no_core_module_imports_io_frameworks_or_the_runtime(path):
    for name in imported_modules(path):
        if any(under(name, allowed) for allowed in ALLOWED_FLAGSTOP_IN_CORE):
            continue
        bad = [f for f in FORBIDDEN_IN_CORE if under(name, f)]
        assert not bad, f"{path.name} imports {name}: the core must stay pure"


@pytest.mark.processes
def test_importing_the_whole_core_loads_none_of_them():
    modules = [f"flagstop.scheduler_svc.core.{p.stem}" for p in CORE.glob("*.py")]
    code = (
        "import importlib, sys\n"
        f"for m in {modules!r}: importlib.import_module(m)\n"
        "print(' '.join(sorted(sys.modules)))"
    )
    loaded = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT
    ).stdout.split()
    runtime = {"flagstop.server", "flagstop.settings", "flagstop.telemetry", "flagstop.health"}
    bad = [
        m for m in loaded
        if m in runtime or any(under(m, f) for f in ("grpc", "google.protobuf", "torch", "asyncio"))
    ]  # fmt: skip
    assert not bad, f"the core pulls in {bad[:5]}"


def test_every_import_of_our_code_goes_through_the_flagstop_package():
    """The folders are also importable by their bare names from a checkout; doing so
    would load a second copy of a module. Nothing may."""
    offenders = []
    for path in ROOT.rglob("*.py"):
        if any(part.startswith(".") for part in path.relative_to(ROOT).parts):
            continue
        for name in imported_modules(path):
            if any(under(name, folder) for folder in FOLDER_NAMES):
                offenders.append(f"{path.relative_to(ROOT)}: {name}")
    assert not offenders, offenders


def runtime_modules() -> dict[str, Path]:
    """Every runtime module by its import name (pyproject's package-dir applied; the
    generated stubs left out)."""
    modules = {}
    for folder in ("flagstop", *FOLDER_NAMES):
        package = "flagstop" if folder == "flagstop" else f"flagstop.{folder}"
        for path in (ROOT / folder).rglob("*.py"):
            parts = path.relative_to(ROOT / folder).with_suffix("").parts
            if "_pb2" in path.name or (folder == "flagstop" and parts[0] in FOLDER_NAMES):
                continue
            modules[".".join((package, *(p for p in parts if p != "__init__")))] = path
    return modules


def flagstop_imports(path: Path) -> set[str]:
    """Every module of ours it imports, anywhere in it (TYPE_CHECKING blocks and
    functions included), a `from package import module` by the module."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("flagstop"):
            names |= {node.module, *(f"{node.module}.{alias.name}" for alias in node.names)}
        elif isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names if alias.name.startswith("flagstop")}
    return names


def test_no_imports_lead_in_a_circle():
    """A circle, even through a TYPE_CHECKING back-pointer or an import inside a
    function, is two rooms that cannot be read (or changed) one without the other."""
    modules = runtime_modules()
    graph = {name: (flagstop_imports(path) & modules.keys()) - {name}
             for name, path in modules.items()}  # fmt: skip
    try:
        graphlib.TopologicalSorter(graph).prepare()
    except graphlib.CycleError as e:
        pytest.fail(f"an import circle: {' -> '.join(e.args[1])}")


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> zipfile.ZipFile:
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
         "-w", str(out), str(ROOT)],
        check=True, capture_output=True, cwd=out,
    )  # fmt: skip
    [path] = out.glob("flagstop-*.whl")
    return zipfile.ZipFile(path)


@pytest.mark.processes
def test_the_wheel_installs_one_top_level_package(wheel):
    top = {name.split("/")[0] for name in wheel.namelist()}
    assert {t for t in top if not t.endswith(".dist-info")} == {"flagstop"}
    names = set(wheel.namelist())
    modules = ["router/service.py", "scheduler_svc/core/scheduler.py", "v1/executor_pb2.py",
               "executor/model_runner.py", "kernels/torch_attention.py"]  # fmt: skip
    for module in modules:
        assert f"flagstop/{module}" in names
    assert not any(n.startswith(("flagstop/tools", "flagstop/tests")) for n in names)
    # Every subpackage, not only those the editable install finds by path (a `pip
    # install .` image once lacked executor/spec, now speculative, and could not start an
    # executor).
    folders = {"flagstop": "", "router": "router/", "scheduler_svc": "scheduler_svc/",
               "executor": "executor/", "kernels": "kernels/"}  # fmt: skip
    for folder, inside in folders.items():
        for init in (ROOT / folder).rglob("__init__.py"):
            package = init.parent.relative_to(ROOT / folder).as_posix()
            wheel_path = f"flagstop/{inside}{'' if package == '.' else package + '/'}__init__.py"
            assert wheel_path.replace("/./", "/") in names, f"{init.parent} is not in the wheel"


@pytest.mark.processes
def test_console_scripts_point_at_importable_entry_points(wheel):
    [entry_points] = [n for n in wheel.namelist() if n.endswith("entry_points.txt")]
    scripts = dict(
        line.split(" = ")
        for line in wheel.read(entry_points).decode().splitlines()
        if " = " in line
    )
    assert set(scripts) == {
        "flagstop-router", "flagstop-scheduler", "flagstop-executor", "flagstop-client",
        "flagstop-health", "flagstop-replay",
    }  # fmt: skip
    code = "; ".join(
        f"from {target.split(':')[0]} import {target.split(':')[1]}" for target in scripts.values()
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


@pytest.mark.processes
def test_a_console_script_runs():
    script = Path(sys.executable).parent / "flagstop-scheduler"
    done = subprocess.run([str(script), "--help"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and "FLAGSTOP_SCHEDULER_MAX_NUM_SEQS" in done.stdout


def test_finish_reasons_have_the_same_values_on_the_wire_and_in_the_core():
    for reason in FinishReason:
        assert scheduler_pb2.RequestFinish.Name(reason) == f"REQUEST_FINISH_{reason.name}"
    for reason in (FinishReason.STOP, FinishReason.LENGTH):
        assert generation_pb2.FinishReason.Name(reason) == f"FINISH_REASON_{reason.name}"
    assert [r.label for r in FinishReason] == ["stop", "length", "abort", "error", "transfer"]


def test_the_routers_kv_roles_are_the_wire_values():
    assert (BOTH, PREFILL, DECODE) == (
        generation_pb2.KV_ROLE_BOTH, generation_pb2.KV_ROLE_PREFILL, generation_pb2.KV_ROLE_DECODE,
    )  # fmt: skip


def defined_names(path: Path) -> set[str]:
    """What a module defines: its functions, classes and names, and its classes'
    methods, fields and attributes (self.x = ...; a folder: every module's in it)."""
    if path.is_dir():
        return set().union(*(defined_names(p) for p in path.rglob("*.py")))
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Assign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {t.id for t in targets if isinstance(t, ast.Name)}
            names |= {t.attr for t in targets if isinstance(t, ast.Attribute)}  # self.x
    return names


def feature_table() -> list[list[str]]:
    """The feature table's rows of docs/layout.md, each cell's backticked entries."""
    text = (ROOT / "docs" / "layout.md").read_text()
    table = text[text.index("| feature | scheduler core |") :].splitlines()[2:]
    return [re.findall(r"`([^`]+)`", line) for line in table if line.startswith("|")]


def test_every_path_and_name_of_the_feature_table_exists():
    """A path, then the names it defines for the feature: a stale row (a file moved,
    a class renamed) fails here."""
    rows = feature_table()
    assert len(rows) >= 12, "the feature table lost rows"
    for entries in rows:
        path = None
        for entry in entries:
            if "/" in entry or entry.endswith(".py"):
                path = ROOT / entry
                assert path.exists(), f"docs/layout.md names {entry}, which is gone"
            else:
                assert path is not None, f"{entry!r} follows no path in its cell"
                assert entry in defined_names(path), f"{entry} is not defined in {path}"
