"""The MPI backend's compiled part (built by setup.py where a C compiler is, optionally):
``_inline_c``, all_reduce's latency path in C, which :mod:`mpidist._backends.mpi.inline` sets up.
A package of its own so that importing it imports nothing else."""
