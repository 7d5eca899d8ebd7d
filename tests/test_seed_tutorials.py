"""The torch.distributed programs of the source documents (the dist_tuto tutorial in
../shared/seeds/001: point-to-point, all_reduce on a group, the ring all-reduce, gradient
averaging; the all_reduce_multigpu example of seeds/002), ported line by line: ``import
mpidist as dist``, numpy arrays for tensors, and nothing else changed but what the
comments at each line say (the porting rules of docs/api.md). Run by mpiexec -n 2, as
the tutorial runs them on two processes."""

from __future__ import annotations

import numpy as np
import pytest
from test_timeout import job

PROGRAM = '''
import os
import sys
import numpy as np
import mpidist as dist
from mpidist.nn import CrossEntropyLoss, Linear


def run_blocking(rank, size):
    """Blocking point-to-point communication."""
    tensor = np.zeros(1)                      # torch.zeros(1)
    if rank == 0:
        tensor += 1
        # Send the tensor to process 1
        dist.send(tensor=tensor, dst=1)
    else:
        # Receive tensor from process 0
        dist.recv(tensor=tensor, src=0)
    print('Rank ', rank, ' has data ', tensor[0])


def run_nonblocking(rank, size):
    """Non-blocking point-to-point communication."""
    tensor = np.zeros(1)                      # torch.zeros(1)
    req = None
    if rank == 0:
        tensor += 1
        # Send the tensor to process 1
        req = dist.isend(tensor=tensor, dst=1)
        print('Rank 0 started sending')
    else:
        # Receive tensor from process 0
        req = dist.irecv(tensor=tensor, src=0)
        print('Rank 1 started receiving')
    req.wait()
    print('Rank ', rank, ' has data ', tensor[0])


def run_all_reduce(rank, size):
    """ Simple collective communication. """
    group = dist.new_group([0, 1])
    tensor = np.ones(1)                       # torch.ones(1)
    dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group)
    print('Rank ', rank, ' has data ', tensor[0])


def allreduce(send, recv):
    """ Implementation of a ring-reduce with addition. """
    rank = dist.get_rank()
    size = dist.get_world_size()
    send_buff = send.copy()                   # send.clone()
    recv_buff = send.copy()                   # send.clone()
    accum = send.copy()                       # send.clone()

    left = ((rank - 1) + size) % size
    right = (rank + 1) % size

    for i in range(size - 1):
        if i % 2 == 0:
            # Send send_buff
            send_req = dist.isend(send_buff, right)
            dist.recv(recv_buff, left)
            accum[:] += recv_buff[:]
        else:
            # Send recv_buff
            send_req = dist.isend(recv_buff, right)
            dist.recv(send_buff, left)
            accum[:] += send_buff[:]
        send_req.wait()
    recv[:] = accum[:]


def average_gradients(model):
    """ Gradient averaging. """
    size = float(dist.get_world_size())
    for param in model.parameters():
        dist.all_reduce(param.grad.data, op=dist.ReduceOp.SUM)
        param.grad.data /= size


def run_multigpu(rank, size):
    """seeds/002: all_reduce_multigpu, one array per "device" of this process."""
    tensor_list = []
    for dev_idx in range(2):                  # range(torch.cuda.device_count())
        tensor_list.append(np.array([1.0]))   # torch.FloatTensor([1]).cuda(dev_idx)
    dist.all_reduce_multigpu(tensor_list)
    print('Rank ', rank, ' multigpu ', [float(t[0]) for t in tensor_list])


def run(rank, size):
    """Everything the tutorial runs, one after the other."""
    sys.stdout = open(f"{sys.argv[1]}/rank{rank}.txt", "w")  # one file per rank: no interleaved lines
    run_blocking(rank, size)
    run_nonblocking(rank, size)
    run_all_reduce(rank, size)
    send, recv = np.arange(4.0) + rank, np.zeros(4)
    allreduce(send, recv)
    print('Rank ', rank, ' ring ', recv.tolist())
    model = Linear(3, 2)                          # Net()
    crit = CrossEntropyLoss()
    crit(model(np.full((4, 3), rank + 1.0, np.float32)), np.array([0, 1, 0, 1]))
    model.backward(crit.backward())               # loss.backward()
    grads = [p.grad.copy() for p in model.parameters()]
    average_gradients(model)
    every = [np.zeros_like(g) for g in grads for _ in range(size)]
    for i, g in enumerate(grads):
        dist.all_gather(every[i * size:(i + 1) * size], g)
    mean = [sum(every[i * size:(i + 1) * size]) / size for i in range(len(grads))]
    print('Rank ', rank, ' averaged ', all(np.allclose(p.grad, m) for p, m in zip(model.parameters(), mean)))
    run_multigpu(rank, size)


def init_process(rank, size, fn, backend='gloo'):
    """ Initialize the distributed environment. """
    os.environ['MASTER_ADDR'] = '127.0.0.1'
    os.environ['MASTER_PORT'] = '29500'
    dist.init_process_group(backend, rank=rank, world_size=size)
    fn(dist.get_rank(), dist.get_world_size())  # fn(rank, size): under MPI init_process(0, 0, ...) passes 0s


if sys.argv[2] == "mpi":
    init_process(0, 0, run, backend='mpi')        # the tutorial's MPI recipe (mpirun -n N python myscript.py)
else:                                             # mp.Process(target=init_process, args=(rank, size, run)):
    init_process(int(os.environ["RANK"]), 2, run)  # the launcher numbers the processes
dist.barrier()
dist.destroy_process_group()
'''


@pytest.mark.parametrize("backend", ["mpi", "gloo"])
def test_tutorial_programs_run_ported_line_by_line(tmp_path, backend):
    """The tutorial's own init_process: its MPI recipe (``init_process(0, 0, run,
    backend='mpi')``: rank and size ignored with torch's warning), and its gloo default with
    the rank the launcher gave (run over MPI, with one warning)."""
    script = tmp_path / "tutorial.py"
    script.write_text(PROGRAM)
    out = job(2, script, str(tmp_path), backend, timeout=120)
    assert out.returncode == 0, out.stderr
    warning = (
        "For MPI backend, world_size (0) and rank (0) are ignored"
        if backend == "mpi"
        else "runs the 'gloo' backend over MPI"
    )
    assert warning in out.stderr, out.stderr
    for rank in (0, 1):
        lines = set((tmp_path / f"rank{rank}.txt").read_text().splitlines())
        assert f"Rank  {rank}  has data  1.0" in lines  # p2p (twice) ...
        assert f"Rank  {rank}  has data  2.0" in lines  # ... and all_reduce over new_group([0, 1])
        assert f"Rank  {rank}  ring  [1.0, 3.0, 5.0, 7.0]" in lines  # (0..3) + (1..4)
        assert f"Rank  {rank}  averaged  True" in lines
        assert f"Rank  {rank}  multigpu  [4.0, 4.0]" in lines  # 2 ranks x 2 "devices"
    assert "Rank 1 started receiving" in lines
    assert "Rank 0 started sending" in (tmp_path / "rank0.txt").read_text()


def test_a_tensor_data_left_in_a_port_is_named(dist):
    """torch's ``t.data`` is a tensor; a plain numpy array's ``.data`` is the raw buffer: the
    error says to pass the array itself (mpidist.nn's ``param.grad.data`` is the array: above)."""
    with pytest.raises(
        TypeError,
        match=r"all_reduce: tensor must be a numpy.ndarray, got memoryview; a numpy "
        r"array's .data is its raw buffer, not an array as torch's tensor.data: "
        r"pass the array itself",
    ):
        dist.all_reduce(np.ones(3).data)
