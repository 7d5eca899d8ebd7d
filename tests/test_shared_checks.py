"""The validation helpers shared by several ops: one check, the same messages from every op."""

import numpy as np
import pytest

from mpidist._arrays.buffers import group_blocks


@pytest.mark.parametrize("gather", [True, False])
def test_group_blocks_checks_dtype_then_the_whole_ones_size(gather):
    part, whole = np.zeros(2), np.zeros((3, 2))
    out, inp = (whole, part) if gather else (part, whole)
    group_blocks(out, inp, 3, "op", "out", "inp", gather)  # stacked: fine
    group_blocks(
        out.reshape(-1) if gather else out, inp if gather else inp.reshape(-1), 3, "op", "out", "inp", gather
    )  # concatenated: fine
    with pytest.raises(TypeError, match=r"inp dtype float32 does not match out dtype float64"):
        group_blocks(out, inp.astype(np.float32), 4, "op", "out", "inp", gather)
    w, p = ("out", "inp") if gather else ("inp", "out")
    with pytest.raises(
        ValueError,
        match=rf"{w} must hold world_size \* {p}.size = 4 \* 2 = 8 elements, "
        rf"got 6 \(shape \(3, 2\)\)",
    ):
        group_blocks(out, inp, 4, "op", "out", "inp", gather)
