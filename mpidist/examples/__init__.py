"""Runnable examples: ``python -m mpidist.examples.train_digits`` is the main job (numpy, mpidist's
own DDP); ``python -m mpidist.examples.train_torch`` is the torch one (torch's DDP over the
"mpidist" backend, needs the ``torch`` extra)."""
