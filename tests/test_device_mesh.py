"""init_device_mesh / DeviceMesh (torch.distributed.device_mesh) over MPI sub-communicators:
layout, groups per dimension, all_reduce along each dimension, slicing by name, errors."""

from __future__ import annotations

import numpy as np
import pytest

import mpidist
from mpidist import DeviceMesh, init_device_mesh

pytestmark = pytest.mark.mpi


def test_one_dimension_is_the_default_group(dist, world):
    rank, size = world
    count = dist.get_pg_count()
    mesh = init_device_mesh("cpu", (size,), mesh_dim_names=("dp",))
    assert dist.get_pg_count() == count  # torch reuses the default group: nothing made
    assert mesh.get_group() is dist.group.WORLD and mesh.get_group("dp") is dist.group.WORLD
    assert mesh.mesh.tolist() == list(range(size)) and mesh.shape == (size,) and mesh.ndim == 1
    assert mesh.get_local_rank() == rank and mesh.get_coordinate() == (rank,) and mesh.get_rank() == rank
    assert mesh.size() == size and mesh.size(0) == size and mesh.device_type == "cpu"
    assert mesh["dp"] is mesh and mesh.mesh_dim_names == ("dp",)
    assert repr(mesh) == f"DeviceMesh((dp={size}), 'cpu', mesh={list(range(size))})"
    with mesh as m:
        assert m is mesh


@pytest.mark.mpi(min_size=4)
def test_two_by_two_all_reduce_along_each_dimension(dist, world):
    rank, size = world
    count = dist.get_pg_count()
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    assert dist.get_pg_count() == count + 4  # two groups per dimension, as torch's new_group per row
    if rank >= 4:
        assert mesh.get_coordinate() is None and mesh.get_local_rank("dp") == -1
        assert mesh.get_group("tp") is dist.GroupMember.NON_GROUP_MEMBER
        assert dist.all_reduce(np.ones(1), group=mesh.get_group("tp")) is None
        return
    i, j = divmod(rank, 2)
    assert mesh.mesh.tolist() == [[0, 1], [2, 3]] and mesh.get_coordinate() == (i, j)
    assert dist.get_process_group_ranks(mesh.get_group("tp")) == [2 * i, 2 * i + 1]  # my row
    assert dist.get_process_group_ranks(mesh.get_group(0)) == [j, 2 + j]  # my column
    assert mesh.get_local_rank("dp") == i and mesh.get_local_rank(1) == j
    assert [dist.get_process_group_ranks(g) for g in mesh.get_all_groups()] == [[j, 2 + j], [2 * i, 2 * i + 1]]
    x = np.full(3, float(rank))
    dist.all_reduce(x, group=mesh.get_group("tp"))
    assert x.tolist() == [4.0 * i + 1] * 3  # 2i + (2i + 1)
    y = np.full(3, float(rank))
    dist.all_reduce(y, group=mesh.get_group("dp"))
    assert y.tolist() == [2.0 * j + 2] * 3  # j + (2 + j)
    tp, dp = mesh["tp"], mesh["dp"]
    assert tp.mesh.tolist() == [2 * i, 2 * i + 1] and dp.mesh.tolist() == [j, 2 + j]
    assert tp.get_group() is mesh.get_group("tp") and dp.get_local_rank() == i and tp.get_coordinate() == (j,)
    assert mesh["dp", "tp"] is mesh
    with pytest.raises(
        KeyError,
        match=r"invalid mesh_dim_names \('tp', 'dp'\): they must be distinct and in the "
        r"mesh's dimension order",
    ):
        mesh["tp", "dp"]  # noqa: B018


@pytest.mark.mpi(min_size=2)
def test_three_dimensions_and_slices(dist, world):
    rank, size = world
    shape = (2, 1, size // 2)
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=("pp", "cp", "tp"))
    n = 2 * (size // 2)
    if rank >= n:
        assert mesh.get_coordinate() is None
        with pytest.raises(ValueError, match=r"is not in this mesh"):
            mesh["tp"].mesh  # noqa: B018
        return
    p, _, t = mesh.get_coordinate()
    assert mesh.get_local_rank("cp") == 0 and dist.get_world_size(mesh.get_group("cp")) == 1
    sub = mesh["pp", "tp"]
    assert sub.shape == (2, size // 2) and sub.mesh.tolist() == np.arange(n).reshape(2, -1).tolist()
    assert sub.get_coordinate() == (p, t) and sub.get_group("tp") is mesh.get_group(2)
    x = np.ones(1)
    dist.all_reduce(x, group=sub.get_group("pp"))
    assert x[0] == 2.0


def test_a_mesh_of_chosen_ranks(dist, world):
    """DeviceMesh(device_type, mesh): any layout; groups hold their ranks sorted, as torch's
    new_group, so get_local_rank is the rank in the sorted group."""
    rank, size = world
    layout = np.arange(size)[::-1].reshape(1, size)
    mesh = DeviceMesh("cpu", layout)
    assert mesh.mesh_dim_names is None and mesh.get_coordinate() == (0, size - 1 - rank)
    assert mesh.get_group(1) is dist.group.WORLD  # a whole-world dimension
    assert dist.get_process_group_ranks(mesh.get_group(0)) == [rank]
    assert mesh.get_local_rank(1) == rank  # not the coordinate: the sorted group's rank
    assert mesh == DeviceMesh("cpu", layout.tolist()) and hash(mesh) == hash(DeviceMesh("cpu", layout))
    with pytest.raises(ValueError, match=r"cannot slice a DeviceMesh without mesh_dim_names"):
        mesh["x"]  # noqa: B018


def test_from_group(dist, world):
    rank, size = world
    g = dist.new_group()
    mesh = DeviceMesh.from_group(g, "cpu", mesh_dim_names=("dp",))
    assert mesh.get_group("dp") is g and mesh.mesh.tolist() == list(range(size)) and mesh.get_local_rank() == rank
    two = DeviceMesh.from_group(
        [g, dist.group.WORLD], "cpu", np.arange(size).reshape(1, size), mesh_dim_names=("a", "b")
    )
    assert two.get_group("b") is dist.group.WORLD and two.get_coordinate() == (0, rank)
    with pytest.raises(ValueError, match=r"DeviceMesh.from_group: mesh and mesh_dim_names are required"):
        DeviceMesh.from_group([g, g], "cpu")
    with pytest.raises(ValueError, match=r"does not list the group's ranks"):
        DeviceMesh.from_group(g, "cpu", mesh=[size + 5])
    dist.destroy_process_group(g)


def test_backend_override(dist, world):
    rank, size = world
    mesh = init_device_mesh(
        "cpu", (size, 1), mesh_dim_names=("a", "b"), backend_override={"a": "mpi", 1: ("mpi", None)}
    )
    assert mesh.get_group("a") is not dist.group.WORLD  # an override makes a group of its own, as torch
    assert dist.get_process_group_ranks(mesh.get_group("a")) == list(range(size))
    with pytest.raises(ValueError, match=r"init_device_mesh: backend_override key 'c' is neither a dimension index"):
        init_device_mesh("cpu", (size,), mesh_dim_names=("a",), backend_override={"c": "mpi"})


def test_errors(dist, world):
    rank, size = world
    with pytest.raises(
        ValueError,
        match=r"init_device_mesh: device_type must be a device type without an index, "
        r"got 'cuda:0'",
    ):
        init_device_mesh("cuda:0", (size,))
    with pytest.raises(ValueError, match=r"device_type must be one of \('cpu', 'cuda'\)"):
        init_device_mesh("xpu", (size,))
    with pytest.raises(
        ValueError,
        match=rf"mesh_shape \({size + 1},\) holds {size + 1} ranks, more than the world "
        rf"size {size}",
    ):
        init_device_mesh("cpu", (size + 1,))
    with pytest.raises(ValueError, match=r"mesh_shape must be a non-empty tuple of positive ints"):
        init_device_mesh("cpu", (0,))
    with pytest.raises(ValueError, match=r"each mesh_dim_name must be unique"):
        init_device_mesh("cpu", (size, 1), mesh_dim_names=("a", "a"))
    with pytest.raises(ValueError, match=r"mesh_dim_names must name each of the mesh's 2 dimensions"):
        init_device_mesh("cpu", (size, 1), mesh_dim_names=("a",))
    with pytest.raises(ValueError, match=r"DeviceMesh: mesh must not repeat a rank"):
        DeviceMesh("cpu", [0, 0])
    with pytest.raises(TypeError, match=r"DeviceMesh: mesh must hold integer global ranks, got dtype float64"):
        DeviceMesh("cpu", [0.0])
    mesh = init_device_mesh("cpu", (size, 1), mesh_dim_names=("a", "b"))
    with pytest.raises(ValueError, match=r"DeviceMesh.get_group: the mesh has 2 dimensions: pass mesh_dim"):
        mesh.get_group()
    with pytest.raises(KeyError, match=r"mesh dimension 'c' does not exist"):
        mesh.get_local_rank("c")
    with pytest.raises(ValueError, match=r"mesh_dim=2 is out of range for a 2-D mesh"):
        mesh.size(2)


@pytest.mark.mpi(min_size=2)
def test_meshes_that_differ_between_ranks_fail_everywhere(dist, world):
    rank, size = world
    with pytest.raises(ValueError, match=r"DeviceMesh: the members of group 'default_pg' passed different meshes"):
        DeviceMesh("cpu", list(range(size)) if rank else list(range(size))[::-1])
    dist.barrier()


def test_init_device_mesh_initializes_the_default_group(dist, world):
    _, size = world
    dist.destroy_process_group()
    try:
        mesh = mpidist.init_device_mesh("cpu", (size,))
        assert mpidist.is_initialized() and mesh.get_group() is mpidist.group.WORLD
    finally:
        if not mpidist.is_initialized():
            mpidist.init_process_group()
