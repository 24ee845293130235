"""Log lines carry their level; --log-format json writes one object per line with the
trace and span ids of the current span, as Jaeger shows them."""

import json
import subprocess
import sys

import pytest

from tools.stack import ROOT

pytestmark = pytest.mark.processes  # every test here runs processes

SCRIPT = """
import logging
from opentelemetry.sdk.trace import TracerProvider
from flagstop import logs
logs.configure("INFO", "{fmt}")
log = logging.getLogger("flagstop.test")
log.info("outside any span")
tracer = TracerProvider().get_tracer("test")
with tracer.start_as_current_span("step") as span:
    context = span.get_span_context()
    print(format(context.trace_id, "032x"), format(context.span_id, "016x"))
    log.warning("inside the span")
log.debug("below the level")
"""


def run(fmt: str) -> tuple[list[str], str]:
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT.format(fmt=fmt)], capture_output=True, text=True,
        cwd=ROOT, check=True, timeout=60,
    )  # fmt: skip
    return done.stderr.strip().splitlines(), done.stdout


def test_json_lines_carry_the_level_and_the_current_span():
    lines, ids = run("json")
    trace_id, span_id = ids.split()
    outside, inside = (json.loads(line) for line in lines)
    assert (outside["level"], outside["message"], outside["name"]) == (
        "INFO",
        "outside any span",
        "flagstop.test",
    )
    assert "trace_id" not in outside
    assert (inside["level"], inside["trace_id"], inside["span_id"]) == (
        "WARNING",
        trace_id,
        span_id,
    )


def test_text_lines_name_their_level():
    lines, _ = run("text")
    assert len(lines) == 2
    assert " INFO flagstop.test outside any span" in lines[0]
    assert " WARNING flagstop.test inside the span" in lines[1]
