"""`make serve`'s supervisor: the local stack's processes, each started again when it
dies, as compose's restart policy and Kubernetes do, so that the local stack behaves
like a deployed one (a killed executor comes back; the router meanwhile places
requests elsewhere). Restarts back off (1 s, doubling to 30 s; back to 1 s after a
minute up) and are logged. A process that exits with an error within its first
--min-uptime-s stops the stack: a start-up error, which it said on its stderr (one
killed by a signal is started again, however soon). SIGINT (Ctrl-C) and
SIGTERM go to every process once; each drains and exits.

    python -m tools.supervise [--no-restart] :: NAME COMMAND... [:: NAME COMMAND...]

(each process's name and command after a `::`, its arguments as the shell split them)

--no-restart (make serve RESTART=0): a process that dies stays dead, for fault tests.
"""

import argparse
import logging
import signal
import subprocess
import sys
import time
from dataclasses import dataclass

log = logging.getLogger("flagstop.supervise")
FIRST_BACKOFF_S, MAX_BACKOFF_S, HEALTHY_AFTER_S = 1.0, 30.0, 60.0


@dataclass
class Child:
    name: str
    command: list[str]
    process: subprocess.Popen | None = None
    started: float = 0.0
    starts: int = 0
    backoff_s: float = FIRST_BACKOFF_S
    due: float = 0.0  # when to start it again (monotonic); 0: not waiting
    exit_code: int | None = None


class Supervisor:
    def __init__(self, children: list[Child], restart: bool, min_uptime_s: float) -> None:
        self.children, self.restart, self.min_uptime_s = children, restart, min_uptime_s
        self.stopping = False

    def start(self, child: Child) -> None:
        from flagstop.server import die_with_parent

        # A process group of its own: a terminal's Ctrl-C reaches the supervisor alone,
        # which passes it on once (a second signal would cut the drain short). Not a
        # session of its own: with the kernel's autogroups (sched_autogroup_enabled)
        # each session shares the CPU as one, so a nice 19 job beside the stack took
        # half the CPU from the executor, whose threads then waited on each other
        # (measured: a 40-token request 0.3 s, then 3.5-6.8 s).
        child.process = subprocess.Popen(child.command, preexec_fn=die_with_parent,
                                         process_group=0)  # fmt: skip
        child.started, child.due = time.monotonic(), 0.0
        child.starts += 1

    def stop(self, signum: int, _frame=None) -> None:
        self.stopping = True
        for child in self.children:
            child.due = 0.0
            if child.process is not None and child.process.poll() is None:
                child.process.send_signal(signum)

    def run(self) -> int:
        for child in self.children:
            self.start(child)
        try:
            while not self._done():
                self._tick()
                time.sleep(0.2)
        finally:
            self.stop(signal.SIGTERM)
            for child in self.children:
                if child.process is not None:
                    child.process.wait()
        return max((c.exit_code or 0 for c in self.children), default=0)

    def _done(self) -> bool:
        """Stopping (or not restarting) and nothing alive or due to start."""
        alive = [c for c in self.children
                 if c.due or (c.process is not None and c.process.poll() is None)]  # fmt: skip
        return not alive and (self.stopping or not self.restart)

    def _tick(self) -> None:
        now = time.monotonic()
        for child in self.children:
            if child.due and now >= child.due and not self.stopping:
                log.warning("starting %s again (start %d)", child.name, child.starts + 1)
                self.start(child)
            if child.process is None or child.due or (code := child.process.poll()) is None:
                continue
            if self.stopping:
                child.exit_code = code
                continue
            if code > 0 and child.starts == 1 and now - child.started < self.min_uptime_s:
                log.error("%s ended (exit %s) %.1f s after starting: stopping the stack",
                          child.name, code, now - child.started)  # fmt: skip
                child.exit_code = code or 1
                self.stop(signal.SIGTERM)
            elif not self.restart:
                log.error("%s ended (exit %s); not restarted (--no-restart)", child.name, code)
                child.process, child.exit_code = None, code
            else:
                self._schedule_restart(child, code, now)

    def _schedule_restart(self, child: Child, code: int, now: float) -> None:
        if now - child.started >= HEALTHY_AFTER_S:
            child.backoff_s = FIRST_BACKOFF_S
        log.error("%s ended (exit %s); starting it again in %g s", child.name, code,
                  child.backoff_s)  # fmt: skip
        child.due = now + child.backoff_s
        child.backoff_s = min(child.backoff_s * 2, MAX_BACKOFF_S)


def parse(argv: list[str]) -> list[Child]:
    """`:: NAME COMMAND... :: NAME COMMAND...` as the processes."""
    if not argv or argv[0] != "::":
        raise SystemExit("the processes: :: NAME COMMAND... [:: NAME COMMAND...]")
    groups, children = [], []
    for token in argv[1:]:
        if token == "::" or not groups:
            groups.append([])
        if token != "::":
            groups[-1].append(token)
    for group in groups:
        if len(group) < 2:
            raise SystemExit(f"{' '.join(group) or '::'}: each process is NAME COMMAND...")
        children.append(Child(group[0], group[1:]))
    return children


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--no-restart", action="store_true", help="a process that dies stays dead")
    parser.add_argument("--min-uptime-s", type=float, default=10.0)
    parser.add_argument("processes", nargs=argparse.REMAINDER)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    supervisor = Supervisor(parse(args.processes), not args.no_restart, args.min_uptime_s)
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, supervisor.stop)
    sys.exit(supervisor.run())


if __name__ == "__main__":
    main()
