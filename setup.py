"""The build's one compiled part: the all_reduce latency path in C (docs/performance.md, "The
compiled latency path"). Optional: where it does not compile, the install goes on without it
and mpidist runs the same path in Python. The metadata is in setup.cfg."""

from setuptools import Extension, setup

try:  # its headers: the array's fields (pyproject.toml's build requirements bring numpy)
    import numpy
except ImportError:  # a build without isolation and without numpy: no extension
    numpy = None

setup(
    ext_modules=[
        Extension(
            "mpidist._backends.mpi._ext._inline_c",
            ["mpidist/_backends/mpi/_ext/_inline_c.c"],
            include_dirs=[numpy.get_include()],
            optional=True,
            extra_compile_args=["-O2"],
        )
    ]
    if numpy is not None
    else []
)
