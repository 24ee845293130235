"""`make serve`'s supervisor (tools/supervise.py) on real processes: a process killed
is started again, not with --no-restart; SIGINT ends them all; a start-up error stops
the stack with its exit code."""

import signal
import subprocess
import sys
import time

import pytest

pytestmark = pytest.mark.processes

# A process that writes its pid to a file named by its argument, then serves until
# SIGINT/SIGTERM, on which it exits 0.
SERVER = ("import os, signal, sys, time; open(sys.argv[1], 'a').write(f'{os.getpid()}\\n'); "
          "signal.signal(signal.SIGINT, lambda *a: sys.exit(0)); "
          "signal.signal(signal.SIGTERM, lambda *a: sys.exit(0)); time.sleep(120)")  # fmt: skip


def supervise(tmp_path, *flags: str) -> subprocess.Popen:
    argv = [sys.executable, "-m", "tools.supervise", *flags]
    for name in ("a", "b"):
        argv += ["::", name, sys.executable, "-c", SERVER, str(tmp_path / name)]
    return subprocess.Popen(argv)


def pids(path) -> list[int]:
    return [int(line) for line in path.read_text().split()] if path.exists() else []


def wait_for(condition, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


@pytest.mark.parametrize("restart", [True, False])
def test_a_killed_process_is_started_again_unless_told_not_to(tmp_path, restart):
    supervisor = supervise(tmp_path, *([] if restart else ["--no-restart"]))
    try:
        wait_for(lambda: pids(tmp_path / "a") and pids(tmp_path / "b"))
        [first] = pids(tmp_path / "a")
        subprocess.run(["kill", "-9", str(first)], check=True)
        if restart:
            wait_for(lambda: len(pids(tmp_path / "a")) == 2)  # after its 1 s backoff
        else:
            time.sleep(2.0)
            assert pids(tmp_path / "a") == [first] and supervisor.poll() is None
        supervisor.send_signal(signal.SIGINT)
        assert supervisor.wait(15) == 0
    finally:
        supervisor.kill()


def test_a_start_up_error_stops_the_stack_with_its_code(tmp_path):
    argv = [sys.executable, "-m", "tools.supervise",
            "::", "bad", sys.executable, "-c", "import sys; sys.exit(3)",
            "::", "good", sys.executable, "-c", SERVER, str(tmp_path / "good")]  # fmt: skip
    assert subprocess.run(argv, timeout=30).returncode == 3
