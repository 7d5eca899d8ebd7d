"""GPU tests (make test-gpu); skipped without CuPy or a CUDA device (conftest.py)."""
