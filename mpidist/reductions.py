"""Reducing collectives besides all_reduce: reduce, reduce_scatter, reduce_scatter_tensor."""
from __future__ import annotations

__all__: list = []
