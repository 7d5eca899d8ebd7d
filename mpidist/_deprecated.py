"""The public names torch 2.13 deprecates, with torch's FutureWarning, over mpidist's
undeprecated implementations (which mpidist itself calls, so it never warns):

* ``all_gather_into_tensor`` -> ``all_gather_single``, ``reduce_scatter_tensor`` ->
  ``reduce_scatter_single`` ("is deprecated" in torch 2.13);
* ``all_reduce_coalesced``, ``all_gather_coalesced`` ("will be deprecated").

``mpidist.all_gather_into_tensor`` is this module's wrapper;
``mpidist.gather_scatter.all_gather_into_tensor`` the implementation.
"""

from __future__ import annotations

import functools
import inspect
import warnings
from typing import Any, Callable, TypeVar, cast

from mpidist import _coalesced, gather_scatter, reductions

__all__ = ["all_gather_into_tensor", "reduce_scatter_tensor", "all_reduce_coalesced", "all_gather_coalesced"]


F = TypeVar("F", bound=Callable[..., Any])


def _deprecated(impl: F, message: str) -> F:
    """``impl`` (same name, signature and docstring) that first warns ``message``
    (FutureWarning, pointing at the caller's line)."""

    @functools.wraps(impl)
    def public(*args: Any, **kwargs: Any) -> Any:
        warnings.warn(message, FutureWarning, stacklevel=2)
        return impl(*args, **kwargs)

    # (impl's docstring dedented: the note before it must not leave its body indented)
    public.__doc__ = f"Deprecated, as in torch 2.13: {message}\n\n{inspect.cleandoc(impl.__doc__ or '')}"
    return cast(F, public)


all_gather_into_tensor = _deprecated(
    gather_scatter.all_gather_into_tensor,
    "`mpidist.all_gather_into_tensor` is deprecated. Please use `mpidist.all_gather_single` instead.",
)
reduce_scatter_tensor = _deprecated(
    reductions.reduce_scatter_tensor,
    "`mpidist.reduce_scatter_tensor` is deprecated. Please use `mpidist.reduce_scatter_single` instead.",
)
all_reduce_coalesced = _deprecated(
    _coalesced.all_reduce_coalesced,
    "`mpidist.all_reduce_coalesced` will be deprecated (torch 2.13); all_reduce each array, or one flat array.",
)
all_gather_coalesced = _deprecated(
    _coalesced.all_gather_coalesced,
    "`mpidist.all_gather_coalesced` will be deprecated (torch 2.13); all_gather_single of one flat array does "
    "the same.",
)
