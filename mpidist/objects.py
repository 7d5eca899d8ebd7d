"""Object collectives: pickled Python objects between ranks (torch.distributed semantics)."""
from __future__ import annotations

__all__: list = []
