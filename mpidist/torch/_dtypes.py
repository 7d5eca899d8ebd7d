"""The torch dtypes numpy lacks, and how mpidist reads them (ml_dtypes)."""

from __future__ import annotations

import torch

__all__ = ["REINTERPRET"]

#: torch dtype -> (torch dtype of the same size to view its memory as, name of the
#: ml_dtypes type that reads it): bfloat16 and the float8 types, which mpidist reduces
#: with numpy ufuncs on ml_dtypes' types
REINTERPRET = {
    torch.bfloat16: (torch.int16, "bfloat16"),
    torch.float8_e4m3fn: (torch.uint8, "float8_e4m3fn"),
    torch.float8_e5m2: (torch.uint8, "float8_e5m2"),
    torch.float8_e4m3fnuz: (torch.uint8, "float8_e4m3fnuz"),
    torch.float8_e5m2fnuz: (torch.uint8, "float8_e5m2fnuz"),
}
