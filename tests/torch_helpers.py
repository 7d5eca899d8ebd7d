"""Shared by the tests of mpidist.torch: the torch process group fixture's body.

torch's default group is initialized once per test module (``init_process_group``
cannot run twice) and destroyed at the module's end. It reuses mpidist's runtime when
mpidist's own tests initialized it first (the ``dist`` fixture), and otherwise starts it
and stops it again, so the two APIs share one process in either order.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.distributed as tdist

import mpidist.torch  # noqa: F401  (registers the backend)

#: the installed torch's version, comparable with tuples (``TORCH < (2, 13)``): the tests of
#: what older torch releases lack (docs/torch.md, "Versions")
TORCH = torch.torch_version.TorchVersion(torch.__version__)
#: torch 2.13's all_gather_single / reduce_scatter_single, under their names before 2.13
#: (all_gather_into_tensor / reduce_scatter_tensor, which 2.13 deprecates) on older torch
all_gather_single = getattr(tdist, "all_gather_single", None) or tdist.all_gather_into_tensor
reduce_scatter_single = getattr(tdist, "reduce_scatter_single", None) or tdist.reduce_scatter_tensor


@contextlib.contextmanager
def torch_world() -> Iterator[None]:
    """torch's default group on backend "mpidist" for the block (reused if up already)."""
    started = not tdist.is_initialized()
    if started:
        tdist.init_process_group("mpidist")
    try:
        yield
    finally:
        if started and tdist.is_initialized():
            tdist.destroy_process_group()


def assert_ddp_step_matches_one_process(rank: int, n: int, device: str = "cuda") -> None:
    """One SGD step of a small MLP (float64) under DDP on ``device``, each of the ``n`` ranks on
    its 4 samples, equals the same step in one process on all 4n samples (rtol 1e-10)."""
    nn = torch.nn
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 2)).double()
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 2)).double().to(device)
    model.load_state_dict(ref.state_dict())
    ddp = nn.parallel.DistributedDataParallel(model)
    g = torch.Generator().manual_seed(7)
    x = torch.randn(4 * n, 6, generator=g, dtype=torch.float64)
    y = torch.randn(4 * n, 2, generator=g, dtype=torch.float64)
    for m, xs, ys in ((ref, x, y), (ddp, x[4 * rank : 4 * rank + 4].to(device), y[4 * rank : 4 * rank + 4].to(device))):
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        opt.zero_grad()
        nn.functional.mse_loss(m(xs), ys).backward()
        opt.step()
    for got, want in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(got.detach().cpu(), want.detach(), rtol=1e-10, atol=0)


def train_ddp(rank: int, device: str, compile_backend: str = "", steps: int = 3, group=None) -> list:
    """``steps`` SGD steps of a small float64 MLP under DDP over ``group`` (default: the default
    group) on ``device`` (each rank on its own 8 samples), compiled with
    ``torch.compile(backend=compile_backend)`` unless that is ""; the parameters after them, on
    the CPU. The same seeds give every call the same model and data, so a compiled run and an
    eager run must agree to rounding."""
    nn = torch.nn
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 2)).double().to(device)
    ddp = nn.parallel.DistributedDataParallel(model, process_group=group)
    run = torch.compile(ddp, backend=compile_backend) if compile_backend else ddp
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    g = torch.Generator().manual_seed(100 + rank)
    for _ in range(steps):
        x = torch.randn(8, 6, generator=g, dtype=torch.float64).to(device)
        y = torch.randn(8, 2, generator=g, dtype=torch.float64).to(device)
        opt.zero_grad()
        nn.functional.mse_loss(run(x), y).backward()
        opt.step()
    return [p.detach().cpu() for p in model.parameters()]


def assert_compiled_ddp_matches_eager(rank: int, device: str, compile_backend: str, group=None) -> list:
    """DDP over ``group`` (default: the default group) compiled with ``compile_backend`` trains
    to the parameters eager DDP reaches on the same group (float64; rtol 1e-9), and the ranks'
    parameters stay identical. Returns the compiled run's parameters."""
    eager = train_ddp(rank, device, group=group)
    compiled = train_ddp(rank, device, compile_backend, group=group)
    for got, want in zip(compiled, eager):
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-12)
    flat = torch.cat([p.reshape(-1) for p in compiled]).to(device)
    root = flat.clone()
    tdist.broadcast(root, src=0)
    assert torch.equal(flat, root), "the ranks' compiled DDP parameters differ"
    return compiled


def assert_compiled_broadcast(rank: int, device: str, compile_backend: str = "aot_eager") -> None:
    """Compiled code that calls ``dist.broadcast`` (Dynamo graph-breaks there, as on gloo)
    gets rank 0's tensor, and the compiled arithmetic around it runs."""

    @torch.compile(backend=compile_backend)
    def f(t: torch.Tensor) -> torch.Tensor:
        t = t + 1
        tdist.broadcast(t, src=0)
        return t * 2

    out = f(torch.full((5,), float(rank), device=device))
    assert torch.equal(out.cpu(), torch.full((5,), 2.0))
