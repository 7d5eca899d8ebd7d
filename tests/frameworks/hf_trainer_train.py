"""The transformers 5 ``Trainer`` over mpidist, the documented way: ``init_process_group("mpidist")``
first (``TrainingArguments.ddp_backend`` has fixed choices), then ``TrainingArguments(use_cpu=True)``;
the Trainer's Accelerate finds the group initialized and uses it. A tiny BERT built from a
``BertConfig`` (no download) learns a sequence classification in which the label is decided by
the first token.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
from _fwcheck import Indexed, finish, out_dir
from mpi4py import MPI

import mpidist.torch  # noqa: F401  registers backend "mpidist"

N, SEQ, VOCAB = 256, 8, 32


def main() -> None:
    if os.environ.get("FW_BACKEND", "mpidist") == "mpidist":
        dist.init_process_group("mpidist")
    # else (FW_BACKEND=mpi): the framework picks backend "mpi" on its own (import mpidist.torch
    # made torch.distributed.is_mpi_available() True) and initializes the group itself
    from transformers import (
        BertConfig,
        BertForSequenceClassification,
        Trainer,
        TrainerCallback,
        TrainingArguments,
        set_seed,
    )
    from transformers.training_args import ParallelMode

    set_seed(0)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, VOCAB, (N, SEQ), generator=g)
    labels = (ids[:, 0] >= VOCAB // 2).long()
    data = Indexed(ids, torch.ones_like(ids), labels, as_dict=("input_ids", "attention_mask", "labels"))
    config = BertConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=SEQ,
        num_labels=2,
    )
    model = BertForSequenceClassification(config)

    losses = []

    class Record(TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "loss" in logs:
                losses.append(float(logs["loss"]))

    args = TrainingArguments(
        output_dir=os.path.join(out_dir(), "hf"),
        use_cpu=True,
        per_device_train_batch_size=16,
        num_train_epochs=4,
        learning_rate=3e-3,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        seed=0,
        dataloader_num_workers=0,
        disable_tqdm=True,
    )
    assert args.parallel_mode == ParallelMode.DISTRIBUTED, args.parallel_mode
    assert args.world_size == MPI.COMM_WORLD.Get_size() and args.process_index == dist.get_rank()
    trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[Record()])
    trainer.train()
    assert isinstance(trainer.model_wrapped, torch.nn.parallel.DistributedDataParallel), type(trainer.model_wrapped)
    finish("hf-trainer", trainer.model.parameters(), losses, data.served, N)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
