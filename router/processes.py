"""flagstop-router --processes N: N router processes on one port.

One Python process tops out near 20k delivered tokens/s (gRPC's per-message cost);
a GPU serving 256 streams at 8 ms steps asks for 32k. The processes share --port and
--http-port through SO_REUSEPORT (the kernel spreads new connections among them),
each with its own scheduler stream, as several routers on one scheduler already
work. This supervisor starts them, sums their metrics on --metrics-port, restarts
one that dies after serving a while, and passes SIGTERM on so all drain."""

import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

from flagstop.router.settings import RouterSettings
from flagstop.server import die_with_parent
from flagstop.telemetry import start_metrics_server

log = logging.getLogger("flagstop.router")


def worker_command(settings: RouterSettings, index: int) -> list[str]:
    """The supervisor's own command line, as one sharing process."""
    return [
        sys.executable, "-m", "flagstop.router", *sys.argv[1:],
        "--processes", "1", "--reuse-port", "--metrics-port", "0",
        "--router-id", f"{settings.router_id}-{index}",
    ]  # fmt: skip


class Supervisor:
    def __init__(self, settings: RouterSettings) -> None:
        self.settings = settings
        self.metrics_dir = tempfile.mkdtemp(prefix="flagstop-router-metrics-")
        self.workers: dict[int, tuple[subprocess.Popen, float]] = {}
        self.stopping = False

    def start(self, index: int) -> None:
        env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": self.metrics_dir}
        # A session of its own: a terminal's Ctrl-C reaches the supervisor alone, which
        # passes it on once (a second signal would cut the drain short).
        process = subprocess.Popen(
            worker_command(self.settings, index), env=env, preexec_fn=die_with_parent,
            start_new_session=True,
        )  # fmt: skip
        self.workers[index] = (process, time.monotonic())

    def stop(self, signum: int, _frame=None) -> None:
        self.stopping = True
        for process, _ in self.workers.values():
            if process.poll() is None:
                process.send_signal(signum)

    def reload(self, signum: int, _frame=None) -> None:
        """SIGHUP: every process reads its scheduler list again."""
        for process, _ in self.workers.values():
            if process.poll() is None:
                process.send_signal(signum)

    def run(self) -> int:
        """Until every process has ended; the exit code: 0 when all drained cleanly."""
        for index in range(self.settings.processes):
            self.start(index)
        try:
            return self._watch()
        finally:
            self.stop(signal.SIGTERM)
            for process, _ in self.workers.values():
                process.wait()
            shutil.rmtree(self.metrics_dir, ignore_errors=True)

    def _watch(self) -> int:
        codes: dict[int, int] = {}
        while len(codes) < len(self.workers):
            for index, (process, started) in list(self.workers.items()):
                if index in codes or (code := process.poll()) is None:
                    continue
                if self.stopping:
                    codes[index] = code
                elif (uptime := time.monotonic() - started) < self.settings.min_uptime_s:
                    log.error("router process %d ended (exit %s) %.1f s after starting: "
                              "stopping", index, code, uptime)  # fmt: skip
                    return code or 1  # it said why on stderr
                else:
                    log.error("router process %d ended (exit %s); starting it again", index, code)
                    self._forget(process.pid)
                    self.start(index)
            time.sleep(0.2)
        return max(codes.values(), default=0)

    def _forget(self, pid: int) -> None:
        from prometheus_client import multiprocess

        multiprocess.mark_process_dead(pid, self.metrics_dir)


def supervise(settings: RouterSettings) -> int:
    supervisor = Supervisor(settings)
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, supervisor.stop)
    signal.signal(signal.SIGHUP, supervisor.reload)
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = supervisor.metrics_dir  # what /metrics sums
    start_metrics_server(settings.metrics_port, settings.host)
    log.info("%d router processes on port %d", settings.processes, settings.port)
    return supervisor.run()
