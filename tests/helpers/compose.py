"""The settings parser of each command the compose files and the Kubernetes manifests
run, with its environment prefix: what their flags and variables are checked against."""

from examples import policy_server
from flagstop.executor.settings import ExecutorSettings
from flagstop.router.settings import RouterSettings
from flagstop.scheduler_svc.settings import SchedulerSettings
from tools import make_model

PARSERS = {
    "flagstop.executor": (ExecutorSettings.load, "FLAGSTOP_EXECUTOR_"),
    "flagstop.scheduler_svc": (SchedulerSettings.load, "FLAGSTOP_SCHEDULER_"),
    "flagstop.router": (RouterSettings.load, "FLAGSTOP_ROUTER_"),
    "tools.make_model": (make_model.parse_args, None),
    "examples.policy_server": (policy_server.PolicySettings.load, "FLAGSTOP_POLICY_"),
}
