"""PyTorch Lightning 2.6 over mpidist: ``Trainer(strategy=DDPStrategy(process_group_backend=
"mpidist", cluster_environment=MPIEnvironment()))`` under ``mpiexec -n N python -m mpidist``.

Two fits in one job, each with its own Trainer and model: first logging with ``self.log(...)``
(rank 0 prints ``FRAMEWORK OK lightning``), then with ``self.log(..., sync_dist=True)``
(``FRAMEWORK OK lightning-sync-dist``). The module overrides ``prepare_data``, which Lightning
runs on local rank 0 inside a barrier on a gloo group of its own.
"""

from __future__ import annotations

import pytorch_lightning as pl
import torch
from _fwcheck import Indexed, finish, out_dir, regression_data
from lightning_fabric.plugins.environments import MPIEnvironment
from mpi4py import MPI
from pytorch_lightning.strategies import DDPStrategy

import mpidist.torch  # noqa: F401  registers backend "mpidist"

N = 256


class Regressor(pl.LightningModule):
    def __init__(self, sync_dist: bool) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
        self.sync_dist, self.losses, self.prepared = sync_dist, [], False

    def prepare_data(self) -> None:
        # Overriding it makes Lightning wrap the call in a barrier on a new gloo group
        # (_InfiniteBarrier), which needs a store shared by the ranks (mpidist's MPIStore).
        self.prepared = True

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.losses.append(loss.item())
        self.log("train_loss", loss, sync_dist=self.sync_dist, on_step=True, on_epoch=True)
        return loss

    def on_train_start(self) -> None:
        self.wrapped = type(self.trainer.strategy.model).__name__

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


def fit(sync_dist: bool) -> None:
    pl.seed_everything(0, verbose=False)
    data = Indexed(*regression_data(N))
    model = Regressor(sync_dist=sync_dist)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=MPI.COMM_WORLD.Get_size(),
        num_nodes=1,
        max_epochs=4,
        strategy=DDPStrategy(process_group_backend="mpidist", cluster_environment=MPIEnvironment()),
        default_root_dir=out_dir(),
        logger=pl.loggers.CSVLogger(out_dir()),
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        log_every_n_steps=1,
    )
    loader = torch.utils.data.DataLoader(data, batch_size=16, shuffle=True)
    trainer.fit(model, loader)
    assert trainer.world_size == MPI.COMM_WORLD.Get_size()
    assert model.wrapped == "DistributedDataParallel", f"Lightning trained a {model.wrapped}, not DDP"
    assert model.prepared == (trainer.local_rank == 0), (model.prepared, trainer.local_rank)
    finish("lightning-sync-dist" if sync_dist else "lightning", model.parameters(), model.losses, data.served, N)


def main() -> None:
    fit(sync_dist=False)
    fit(sync_dist=True)


if __name__ == "__main__":
    main()
