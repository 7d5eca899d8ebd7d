"""A small array-module-agnostic neural-network toolkit with explicit backward.

The torch.nn programming model on numpy (and cupy) arrays, without autograd:
``module(x)`` caches what ``module.backward(grad_output)`` needs; backward
accumulates each parameter's ``grad`` and fires its post-accumulate-grad hooks,
which is where DistributedDataParallel starts reducing.
"""
from mpidist.nn.loss import CrossEntropyLoss
from mpidist.nn.modules import Linear, Module, ReLU, Sequential
from mpidist.nn.parameter import Parameter, RemovableHandle

__all__ = ["Parameter", "RemovableHandle", "Module", "Linear", "ReLU", "Sequential", "CrossEntropyLoss"]
