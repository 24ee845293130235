"""A pooling request's task by name: its PoolingTask enum's own name, lower-cased
without the prefix (POOLING_TASK_EMBED is "embed"). One rule for the router, which
words its refusals by it, and the executor, which pools by it."""

from flagstop.v1 import generation_pb2

_PREFIX = "POOLING_TASK_"
_UNSPECIFIED = generation_pb2.POOLING_TASK_UNSPECIFIED


def task_name(task: int) -> str:
    """The task's name; "" for an unspecified or unknown one."""
    if task == _UNSPECIFIED or task not in generation_pb2.PoolingTask.values():
        return ""
    return generation_pb2.PoolingTask.Name(task).removeprefix(_PREFIX).lower()


def task_value(name: str) -> int:
    """The enum value of a task's name (a name task_name gave)."""
    return generation_pb2.PoolingTask.Value(_PREFIX + name.upper())
