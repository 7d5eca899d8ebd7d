"""The default random generator of :mod:`mpidist.nn`: ``manual_seed`` as ``torch.manual_seed``.

torch draws layer initializations and dropout masks from one process-wide default
generator, seeded from fresh entropy at start (``torch.initial_seed()`` differs between
runs) until ``torch.manual_seed(s)`` reseeds it. Here the same: every layer constructed
without ``rng=`` and every :class:`~mpidist.nn.Dropout` forward without ``rng=`` draws
from one ``numpy.random.Generator`` (PCG64); :func:`manual_seed` replaces it by
``numpy.random.default_rng(seed)``. The numbers differ from torch's (another bit
generator); the reproducibility is the same: after ``manual_seed(s)`` the same sequence
of constructions and forwards gives the same values, on every rank that was given ``s``.
"""

from __future__ import annotations

from typing import Any, cast

import numpy as np

from mpidist.nn._util import check_int, prefix

__all__ = ["manual_seed", "initial_seed", "generator"]

_MIN_SEED, _MAX_SEED = -0x8000_0000_0000_0000, 0xFFFF_FFFF_FFFF_FFFF  # torch's accepted range


class _Default:
    # Without an argument, SeedSequence draws its entropy as one int (the stubs allow any).
    seed: int = int(cast(int, np.random.SeedSequence().entropy)) % 2**64
    gen: np.random.Generator = np.random.default_rng(seed)


def manual_seed(seed: int) -> np.random.Generator:
    """Reseed the default generator of :mod:`mpidist.nn`; returns it (``torch.manual_seed``).

    Args:
        seed: an int in torch's range [-2**63, 2**64); a negative seed is taken modulo 2**64,
            as torch does.

    Subsequent layer initializations (``Linear(..., rng=None)``) and dropout masks
    (``Dropout(..., rng=None)``) draw from it. Layers given ``rng=`` keep using theirs.

    Raises:
        TypeError: ``seed`` is not an int.  ValueError: out of range.
    """
    check_int(seed, "seed", "manual_seed")
    if not _MIN_SEED <= seed <= _MAX_SEED:
        raise ValueError(f"{prefix('manual_seed')} seed must be in [{_MIN_SEED}, {_MAX_SEED}], got {seed}")
    _Default.seed = int(seed) % 2**64
    _Default.gen = np.random.default_rng(_Default.seed)
    return _Default.gen


def initial_seed() -> int:
    """The seed of the default generator (``torch.initial_seed``): the last :func:`manual_seed`,
    or the entropy drawn at import."""
    return _Default.seed


def generator(rng: Any, op: str) -> np.random.Generator:
    """The generator a layer draws from: (``None``) the default generator of the moment, else
    ``numpy.random.default_rng(rng)`` (``rng`` itself if it is a Generator; a new one for a seed).

    Raises TypeError for what ``numpy.random.default_rng`` does not take.
    """
    if rng is None:
        return _Default.gen
    if isinstance(rng, bool):
        raise TypeError(f"{prefix(op)} rng must be a numpy.random.Generator, a seed or None, got bool")
    try:
        return np.random.default_rng(rng)
    except (TypeError, ValueError) as exc:
        raise TypeError(
            f"{prefix(op)} rng must be a numpy.random.Generator, a seed or None, got {type(rng).__name__}: {exc}"
        ) from None
