"""The backends that run an op's body: MPI on host arrays (:mod:`.mpi`) and the device backends
(:mod:`.device`: NCCL, CUDA-aware MPI, host staging, and the router that picks one).
"""
