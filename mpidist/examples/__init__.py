"""Runnable examples; ``python -m mpidist.examples.train_digits`` is the main job."""
