"""Device (GPU) support every layer may use: the device runtime (CuPy, or the tests' host-backed
stand-in), CUDA-awareness detection, device binding at init, each op's array arguments.

The device backends that move device arrays are in :mod:`mpidist._runtime.backend_queries.device`.
"""
