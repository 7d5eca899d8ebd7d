"""State-dict helpers, as ``torch.nn.modules.utils``."""

from __future__ import annotations

from collections.abc import MutableMapping

from mpidist.nn._util import prefix as _where

__all__ = ["consume_prefix_in_state_dict_if_present"]


def consume_prefix_in_state_dict_if_present(state_dict: MutableMapping, prefix: str) -> None:  # noqa: A002
    """Strip ``prefix`` from the keys of ``state_dict`` that start with it, in place.

    torch's ``torch.nn.modules.utils.consume_prefix_in_state_dict_if_present``: a state dict
    saved from a :class:`~mpidist.parallel.DistributedDataParallel` (keys ``"module.<name>"``,
    as torch's DDP) loads into the bare model after
    ``consume_prefix_in_state_dict_if_present(state, "module.")``. Keys without the prefix
    are left alone; the order of the other keys is kept, the stripped ones move to the end
    (as torch, which pops and re-inserts them).

    Raises:
        TypeError: ``state_dict`` is not a mutable mapping, or ``prefix`` not a str.
    """
    op = "consume_prefix_in_state_dict_if_present"
    if not isinstance(state_dict, MutableMapping):
        raise TypeError(f"{_where(op)} state_dict must be a mutable mapping (a dict), got {type(state_dict).__name__}")
    if not isinstance(prefix, str):
        raise TypeError(f"{_where(op)} prefix must be a str, got {type(prefix).__name__}")
    for key in list(state_dict):
        if isinstance(key, str) and key.startswith(prefix):
            state_dict[key[len(prefix) :]] = state_dict.pop(key)
