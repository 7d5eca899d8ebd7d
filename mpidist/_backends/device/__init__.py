"""The device backends: which path a call with GPU arrays takes (route, paths) and each path:
NCCL, CUDA-aware MPI, host staging and its pipeline (docs/device.md)."""
