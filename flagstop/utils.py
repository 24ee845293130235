"""Arithmetic every layer shares; pure Python, importable by the scheduler core."""


def cdiv(a: int, b: int) -> int:
    """Ceiling division: the blocks that hold a tokens at b per block."""
    return -(a // -b)
