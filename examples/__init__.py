"""Examples to start from: a SchedulerPolicy service (policy_server.py)."""
