"""A small array-module-agnostic neural-network toolkit with explicit backward.

The torch.nn programming model on numpy (and cupy) arrays, without autograd:
``module(x)`` caches what ``module.backward(grad_output)`` needs; backward
accumulates each parameter's ``grad`` and fires its post-accumulate-grad hooks,
which is where DistributedDataParallel starts reducing. :func:`manual_seed` seeds
layer initialization and dropout masks as ``torch.manual_seed`` does.
"""

from mpidist.nn._random import initial_seed, manual_seed
from mpidist.nn.loss import CrossEntropyLoss, MSELoss, NLLLoss
from mpidist.nn.modules import Dropout, Linear, LogSoftmax, Module, ReLU, Sequential
from mpidist.nn.parameter import Parameter, RemovableHandle
from mpidist.nn.utils import consume_prefix_in_state_dict_if_present

__all__ = [
    "Parameter",
    "RemovableHandle",
    "Module",
    "Linear",
    "ReLU",
    "Dropout",
    "LogSoftmax",
    "Sequential",
    "CrossEntropyLoss",
    "NLLLoss",
    "MSELoss",
    "manual_seed",
    "initial_seed",
    "consume_prefix_in_state_dict_if_present",
]
