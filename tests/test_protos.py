import filecmp
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.processes  # every test here runs processes

ROOT = Path(__file__).resolve().parents[1]
PROTOS = ROOT / "flagstop" / "v1"  # the committed stubs


def test_generated_stubs_are_up_to_date(tmp_path):
    shutil.copytree(ROOT / "protos", tmp_path / "protos", ignore=shutil.ignore_patterns("*_pb2*"))
    out = tmp_path / "protos"
    protos = sorted(str(p.relative_to(tmp_path / "protos")) for p in out.rglob("*.proto"))
    subprocess.run(
        [sys.executable, "-m", "grpc_tools.protoc", "-I.", "--python_out=.", "--pyi_out=.",
         "--grpc_python_out=.", *protos],
        cwd=out, check=True,
    )  # fmt: skip
    generated = sorted(p.name for p in (out / "flagstop" / "v1").glob("*_pb2*"))
    committed = sorted(p.name for p in PROTOS.glob("*_pb2*"))
    assert generated == committed
    stale = [
        n
        for n in generated
        if not filecmp.cmp(out / "flagstop" / "v1" / n, PROTOS / n, shallow=False)
    ]
    assert not stale, f"stale stubs, run `make proto`: {stale}"
