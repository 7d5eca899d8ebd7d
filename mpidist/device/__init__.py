"""Device (GPU) arrays: which path a call takes and the machinery of each path.

Internal package. The public ops in :mod:`mpidist.collectives`, :mod:`mpidist.reductions`,
:mod:`mpidist.gather_scatter` and :mod:`mpidist.p2p` hand a call whose arrays live on a
GPU to :mod:`mpidist.device`, which sends it through CUDA-aware MPI, NCCL or host staging.
"""
