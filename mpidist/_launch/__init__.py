"""Starting and ending the process's part of the job: MPI_Init and MPI_Finalize under a bound,
the watchers and launcher files that keep a failed job clean, the rank environment, MPI_Abort.

The lowest layer: it imports nothing else of mpidist (docs/architecture.md).
"""
