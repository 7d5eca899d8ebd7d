from typing import Any

def all_reduce(tensor: Any, op: Any, g: Any, async_op: Any, algorithm: Any, /) -> bool: ...
def setup(
    address: int,
    in_place: int,
    handle_size: int,
    comm_get: Any,
    ndarray: type,
    collectives: dict[str, Any],
    recorder: dict[str, Any],
    checks: dict[str, Any],
    unchecked: Any,
    failed: Any,
    avg: Any,
    period_mask: int,
    t_end: int,
    state: int,
    /,
) -> None: ...
