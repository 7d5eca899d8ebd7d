"""The host array type of parameters and gradients: ``.data`` is the array itself, as in torch.

torch code reaches a tensor's storage through ``.data`` (``param.grad.data``): the
distributed tutorial averages gradients with ``dist.all_reduce(param.grad.data)`` and
``param.grad.data /= size``. On a plain numpy array ``.data`` is a ``memoryview`` that
collectives refuse and ``/=`` cannot update. :class:`DataArray` is a numpy array in every
other respect (``isinstance(a, numpy.ndarray)``, same memory, same arithmetic); only its
``.data`` differs. cupy arrays are left alone: their ``.data`` is the device pointer cupy
itself relies on.
"""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = ["DataArray", "as_data_array"]


class DataArray(np.ndarray):
    """``numpy.ndarray`` whose ``.data`` returns the array itself (torch's ``Tensor.data``).

    ``a.data`` is ``a``: usable as a collective's argument (``dist.all_reduce(p.grad.data)``
    reduces ``p.grad`` in place) and in in-place arithmetic (``p.grad.data /= n``).
    Assigning ``a.data = b`` copies ``b`` into ``a`` in place (``b`` must broadcast to
    ``a.shape``); torch would rebind the tensor to ``b``'s storage instead. The raw buffer
    is still available as ``memoryview(a)``.
    """

    @property  # type: ignore[override]  # torch-like ``.data`` replaces numpy's memoryview on purpose
    def data(self) -> DataArray:
        return self

    @data.setter
    def data(self, value: Any) -> None:
        if value is not self:  # ``a.data /= n`` assigns the (in-place) result back
            self[...] = value


def as_data_array(x: Any) -> Any:
    """``x`` viewed as a :class:`DataArray` if it is a plain numpy array (no copy); else ``x``."""
    return x.view(DataArray) if type(x) is np.ndarray else x
