"""Array adapters every op uses: numpy or cupy, MPI buffer specs and datatypes, reduce ops."""
