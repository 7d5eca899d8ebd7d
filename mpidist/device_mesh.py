"""DeviceMesh and init_device_mesh (torch.distributed.device_mesh) over MPI sub-communicators.

A mesh lays global ranks out in an n-dimensional array; along each dimension, the ranks
that differ only in that coordinate form a group::

    mesh = mpidist.init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    mpidist.all_reduce(x, group=mesh.get_group("tp"))   # over my row
    mesh["dp"].get_local_rank()                         # my index in my column

The groups of one dimension come from one ``MPI_Comm_split`` of the default group
(:func:`mpidist.groups.split`), after one small all-reduce checking that every rank passed
the same mesh. ``device_type`` (``"cpu"``: numpy, ``"cuda"``: cupy) only says where the
program keeps its arrays; each group's backend decides how they travel. No DTensors.
Differences from torch: docs/api.md, "Device mesh".
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, Optional, Union

import numpy as np

from mpidist._core.group import ProcessGroup
from mpidist._runtime import world as runtime
from mpidist.errors import prefix
from mpidist.groups import GroupMember, _check_backend, _counted, agree, get_process_group_ranks, split

__all__ = ["DeviceMesh", "init_device_mesh"]

#: the device types a mesh may name: host (numpy) and CUDA (cupy) arrays
DEVICE_TYPES = ("cpu", "cuda")

Dim = Union[int, str]


def _check_device_type(device_type: Any, op: str) -> str:
    if not isinstance(device_type, str):
        raise TypeError(
            f"{prefix(op)} device_type must be a string ('cpu' or 'cuda'), got {type(device_type).__name__}"
        )
    if not device_type.isalpha():
        raise ValueError(
            f"{prefix(op)} device_type must be a device type without an index, got {device_type!r}; "
            f"pass the device's type, e.g. 'cuda' for 'cuda:0'"
        )
    if device_type not in DEVICE_TYPES:
        raise ValueError(
            f"{prefix(op)} device_type must be one of {DEVICE_TYPES} (numpy or cupy arrays), got {device_type!r}"
        )
    return device_type


def _check_names(names: object, ndim: int, op: str) -> Optional[tuple[str, ...]]:
    if names is None:
        return None
    if isinstance(names, str) or not isinstance(names, Sequence) or not all(isinstance(n, str) for n in names):
        raise TypeError(f"{prefix(op)} mesh_dim_names must be a tuple of strings, got {names!r}")
    names = tuple(names)
    if len(set(names)) != len(names):
        raise ValueError(f"{prefix(op)} each mesh_dim_name must be unique, got {names}")
    if len(names) != ndim:
        raise ValueError(
            f"{prefix(op)} mesh_dim_names must name each of the mesh's {ndim} dimensions, got "
            f"{len(names)} names {names}"
        )
    return names


def _check_mesh(mesh: Any, world_size: int, op: str) -> np.ndarray:
    try:
        arr = np.array(mesh)
    except (TypeError, ValueError) as exc:  # ragged nested lists
        raise ValueError(f"{prefix(op)} mesh must be an n-dimensional array of global ranks: {exc}") from None
    if arr.size == 0 or arr.ndim == 0:
        raise ValueError(
            f"{prefix(op)} mesh must be an array of at least one dimension and one rank, got shape {arr.shape}"
        )
    if arr.dtype.kind not in "iu":
        raise TypeError(f"{prefix(op)} mesh must hold integer global ranks, got dtype {arr.dtype}")
    if arr.min() < 0 or arr.max() >= world_size:
        raise ValueError(
            f"{prefix(op)} mesh ranks must be in [0, {world_size}) (the default group's size), got "
            f"{arr.min()} .. {arr.max()}"
        )
    if np.unique(arr).size != arr.size:
        raise ValueError(f"{prefix(op)} mesh must not repeat a rank, got {arr.tolist()}")
    return arr.astype(np.int64)


def _backend_of(value: Any, op: str) -> Optional[str]:
    """A backend_override value: a backend string, ``(backend, options)``, or options
    alone (no backend; options are ignored, as pg_options everywhere)."""
    if isinstance(value, tuple) and len(value) == 2:
        value = value[0]
    if value is None or not isinstance(value, str):
        return None
    return _check_backend(value, op)


class DeviceMesh:
    """An n-dimensional layout of global ranks with one process group per dimension
    (torch.distributed.device_mesh.DeviceMesh).

    Args:
        device_type: ``"cpu"`` or ``"cuda"`` (see the module docstring).
        mesh: an n-d array (or nested list) of distinct global ranks; every rank of the
            default group passes the same one. Ranks the mesh leaves out belong to none
            of its groups.
        mesh_dim_names: a unique name per dimension, for ``mesh["dp"]`` and
            ``get_group("dp")``.
        backend_override: per dimension, None or a backend (``"mpi"``, ``"nccl"``, or
            ``(backend, options)``) for that dimension's groups; default: the default
            group's backend.

    Collective over every rank of the default group (it makes the groups), which
    init_process_group must have made.

    Raises:
        TypeError / ValueError: a bad device type, mesh (not integers, ranks out of
            range or repeated), names (not unique, not one per dimension), backends;
            a mesh or names that differ between ranks (ValueError on every rank).
    """

    def __init__(
        self,
        device_type: str,
        mesh: Any,
        *,
        mesh_dim_names: Optional[Sequence[str]] = None,
        backend_override: Optional[Sequence[Any]] = None,
    ) -> None:
        op = "DeviceMesh"
        st = runtime.state()
        device_type = _check_device_type(device_type, op)
        arr = _check_mesh(mesh, st.world_size, op)
        names = _check_names(mesh_dim_names, arr.ndim, op)
        if backend_override is None:
            backends: list[Optional[str]] = [None] * arr.ndim
        elif isinstance(backend_override, (list, tuple)) and len(backend_override) == arr.ndim:
            backends = [_backend_of(b, op) for b in backend_override]
        else:
            raise ValueError(
                f"{prefix(op)} backend_override must hold one entry per mesh dimension ({arr.ndim}), "
                f"got {backend_override!r}"
            )
        agree(
            st.world,
            [device_type, arr.shape, arr.reshape(-1).tolist(), names, backends],
            op,
            "meshes (device_type, mesh, mesh_dim_names, backend_override)",
        )
        groups = [self._make_groups(st, arr, d, names, backend, op) for d, backend in enumerate(backends)]
        self._set(device_type, arr, names, groups, _coordinate(arr, st.rank))

    @staticmethod
    def _make_groups(
        st: runtime.RuntimeState,
        arr: np.ndarray,
        dim: int,
        names: Optional[tuple[str, ...]],
        backend: Optional[str],
        op: str,
    ) -> ProcessGroup:
        """This rank's group along ``dim``: the default group when a group along it holds
        every rank (and no backend is imposed), as torch; else one MPI_Comm_split."""
        if arr.shape[dim] == st.world_size and backend is None:
            return st.world
        rows = np.moveaxis(arr, dim, -1).reshape(-1, arr.shape[dim])
        desc = f"mesh_{names[dim] if names else f'dim_{dim}'}"
        mine = split(st.world, [sorted(int(r) for r in row) for row in rows], op, backend or st.backend, desc)
        _counted(len(rows))  # as torch's new_group per row
        return GroupMember.NON_GROUP_MEMBER if mine is None else mine

    def _set(
        self,
        device_type: str,
        mesh: np.ndarray,
        names: Optional[tuple[str, ...]],
        groups: list[ProcessGroup],
        coordinate: Optional[tuple[int, ...]],
        whole: bool = True,
    ) -> None:
        self._device_type = device_type
        self._mesh = mesh
        self._mesh.flags.writeable = False
        self._names = names
        self._groups = groups
        self._coordinate = coordinate
        self._whole = whole  # False: a slice of a larger mesh made for a rank outside it

    @classmethod
    def _from_parts(cls, *parts: Any) -> DeviceMesh:
        """A mesh made of ``parts``: :meth:`_set`'s arguments."""
        obj = cls.__new__(cls)
        obj._set(*parts)
        return obj

    @staticmethod
    def from_group(
        group: Union[ProcessGroup, Sequence[ProcessGroup]],
        device_type: str,
        mesh: Any = None,
        *,
        mesh_dim_names: Optional[Sequence[str]] = None,
    ) -> DeviceMesh:
        """A mesh over existing groups, without communicating (DeviceMesh.from_group).

        One group: a 1-D mesh of its members (``mesh``, if given, must list them in
        group-rank order). Several groups: ``mesh`` (one dimension per group) and
        ``mesh_dim_names`` are required, and ``group[d]`` is this rank's group along
        dimension ``d`` (not checked against ``mesh``, as torch does not).

        Raises:
            ValueError: a mesh that does not match the group, missing mesh or names,
                a mesh with another number of dimensions than groups;
                ``NON_GROUP_MEMBER`` as the one group.
        """
        op = "DeviceMesh.from_group"
        st = runtime.state()
        device_type = _check_device_type(device_type, op)
        if isinstance(group, ProcessGroup):
            ranks = get_process_group_ranks(group)
            if mesh is not None and np.array(mesh).reshape(-1).tolist() != ranks:
                raise ValueError(f"{prefix(op)} mesh {np.array(mesh).tolist()} does not list the group's ranks {ranks}")
            arr = np.array(ranks, np.int64)
            names = _check_names(mesh_dim_names, 1, op)
            return DeviceMesh._from_parts(device_type, arr, names, [group], _coordinate(arr, st.rank))
        groups = list(group)
        if not groups:
            raise ValueError(f"{prefix(op)} expects at least one ProcessGroup")
        if mesh is None or mesh_dim_names is None:
            raise ValueError(f"{prefix(op)} mesh and mesh_dim_names are required with several groups")
        arr = _check_mesh(mesh, st.world_size, op)
        if arr.ndim != len(groups):
            raise ValueError(
                f"{prefix(op)} mesh has {arr.ndim} dimensions but {len(groups)} groups were given; "
                f"expected one group per dimension"
            )
        names = _check_names(mesh_dim_names, arr.ndim, op)
        return DeviceMesh._from_parts(device_type, arr, names, groups, _coordinate(arr, st.rank))

    # -- what the mesh is ----------------------------------------------------------------------
    @property
    def device_type(self) -> str:
        """``"cpu"`` or ``"cuda"``."""
        return self._device_type

    @property
    def mesh(self) -> np.ndarray:
        """The global ranks of this mesh (read-only int64 array). For a mesh sliced from a
        larger one by name, the slice through this rank, as torch.

        Raises:
            ValueError: a slice asked by a rank outside the mesh, when there are several.
        """
        if not self._whole:
            raise ValueError(
                f"{prefix('DeviceMesh.mesh')} rank {runtime.get_rank()} is not in this mesh, which "
                f"is one of several slices of a larger mesh; ask on a rank that is in it"
            )
        return self._mesh

    @property
    def mesh_dim_names(self) -> Optional[tuple[str, ...]]:
        """The dimensions' names, or None."""
        return self._names

    @property
    def ndim(self) -> int:
        return self._mesh.ndim

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self._mesh.shape)

    def size(self, mesh_dim: Optional[Dim] = None) -> int:
        """The number of ranks in the mesh, or along dimension ``mesh_dim`` (an index, or a
        name: an mpidist extension)."""
        if mesh_dim is None:
            return int(self._mesh.size)
        return int(self._mesh.shape[self._dim(mesh_dim, "DeviceMesh.size")])

    def _dim(self, mesh_dim: Any, op: str) -> int:
        """The index of dimension ``mesh_dim`` (an int, negative from the end, or a name)."""
        if isinstance(mesh_dim, str):
            if not self._names or mesh_dim not in self._names:
                raise KeyError(
                    f"{prefix(op)} mesh dimension {mesh_dim!r} does not exist; the mesh's "
                    f"mesh_dim_names are {self._names}"
                )
            return self._names.index(mesh_dim)
        if not isinstance(mesh_dim, (int, np.integer)) or isinstance(mesh_dim, bool):
            raise TypeError(
                f"{prefix(op)} mesh_dim must be an int or a dimension's name, got {type(mesh_dim).__name__}"
            )
        if not -self.ndim <= mesh_dim < self.ndim:
            raise ValueError(f"{prefix(op)} mesh_dim={mesh_dim} is out of range for a {self.ndim}-D mesh")
        return int(mesh_dim) % self.ndim

    def _one_dim(self, mesh_dim: Optional[Dim], op: str) -> int:
        if mesh_dim is None:
            if self.ndim > 1:
                raise ValueError(
                    f"{prefix(op)} the mesh has {self.ndim} dimensions: pass mesh_dim (an index or a "
                    f"name), or use get_all_groups()"
                )
            return 0
        return self._dim(mesh_dim, op)

    # -- groups and ranks ----------------------------------------------------------------------
    def get_group(self, mesh_dim: Optional[Dim] = None) -> ProcessGroup:
        """This rank's group along ``mesh_dim`` (index or name; may be omitted on a 1-D mesh).
        ``GroupMember.NON_GROUP_MEMBER`` on a rank outside the mesh, so collectives on it
        are no-ops there (torch fails on such ranks).

        Raises:
            ValueError: ``mesh_dim`` omitted on a mesh of several dimensions, or out of
                range.
            KeyError: an unknown name (as torch).
        """
        return self._groups[self._one_dim(mesh_dim, "DeviceMesh.get_group")]

    def get_all_groups(self) -> list[ProcessGroup]:
        """This rank's group along every dimension, in dimension order."""
        return list(self._groups)

    def get_local_rank(self, mesh_dim: Optional[Dim] = None) -> int:
        """This rank's rank in its group along ``mesh_dim`` (torch: ``get_rank(get_group(dim))``;
        on a mesh made by init_device_mesh, the coordinate along that dimension); -1 on a
        rank outside the mesh. Errors as :meth:`get_group`."""
        return runtime.get_rank(self._groups[self._one_dim(mesh_dim, "DeviceMesh.get_local_rank")])

    def get_rank(self) -> int:
        """This process's global rank."""
        return runtime.get_rank()

    def get_coordinate(self) -> Optional[tuple[int, ...]]:
        """This rank's index in the mesh, one int per dimension; None outside the mesh."""
        return self._coordinate

    def __getitem__(self, mesh_dim_names: Union[str, Sequence[str]]) -> DeviceMesh:
        """The sub-mesh of the named dimensions through this rank, with the same groups
        (``mesh["tp"]``: this rank's row of a ("dp", "tp") mesh; ``mesh["dp", "cp"]`` of a
        3-D one). The names must come in the mesh's dimension order. No communication.

        Raises:
            ValueError: a mesh without mesh_dim_names.
            KeyError: an unknown name, or names out of order (as torch).
        """
        op = "DeviceMesh.__getitem__"
        if not self._names:
            raise ValueError(f"{prefix(op)} cannot slice a DeviceMesh without mesh_dim_names")
        names = (mesh_dim_names,) if isinstance(mesh_dim_names, str) else tuple(mesh_dim_names)
        if names == self._names:
            return self
        dims = [self._dim(n, op) for n in names]
        if dims != sorted(set(dims)):
            raise KeyError(
                f"{prefix(op)} invalid mesh_dim_names {names}: they must be distinct and in the mesh's "
                f"dimension order {self._names}"
            )
        coord = self._coordinate
        through = coord if coord is not None else (0,) * self.ndim
        index = tuple(slice(None) if d in dims else through[d] for d in range(self.ndim))
        others = math.prod(self._mesh.shape[d] for d in range(self.ndim) if d not in dims)
        sub = np.ascontiguousarray(self._mesh[index])
        return DeviceMesh._from_parts(
            self._device_type,
            sub,
            names,
            [self._groups[d] for d in dims],
            None if coord is None else tuple(coord[d] for d in dims),
            coord is not None or others == 1,  # whole
        )

    # -- the rest of torch's surface -----------------------------------------------------------
    def __enter__(self) -> DeviceMesh:
        """``with mesh:`` (torch makes it the current mesh for DTensor; nothing here reads it)."""
        return self

    def __exit__(self, *exc: Any) -> None:
        return None

    def __repr__(self) -> str:
        dims = (
            ", ".join(f"{n}={s}" for n, s in zip(self._names, self.shape))
            if self._names
            else ", ".join(str(s) for s in self.shape)
        )
        return f"DeviceMesh(({dims}), '{self._device_type}', mesh={self._mesh.tolist()})"

    def _key(self) -> tuple[Any, ...]:
        return (self._device_type, self.shape, tuple(self._mesh.reshape(-1).tolist()), self._names)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, DeviceMesh) and self._key() == other._key()

    def __hash__(self) -> int:
        return hash(self._key())


def _coordinate(mesh: np.ndarray, rank: int) -> Optional[tuple[int, ...]]:
    found = np.argwhere(mesh == rank)
    return tuple(int(i) for i in found[0]) if len(found) else None


def init_device_mesh(
    device_type: str,
    mesh_shape: Sequence[int],
    *,
    mesh_dim_names: Optional[Sequence[str]] = None,
    backend_override: Optional[dict[Dim, Any]] = None,
) -> DeviceMesh:
    """A :class:`DeviceMesh` of ranks ``0 .. prod(mesh_shape) - 1`` laid out in row-major
    order in ``mesh_shape`` (torch.distributed.device_mesh.init_device_mesh): for
    ``(2, 4)``, dimension 1's groups are ``[0..3]`` and ``[4..7]``, dimension 0's
    ``[0, 4]``, ``[1, 5]``, ...

    Collective over every rank of the default group, which it makes first
    (``init_process_group()``) if needed, as torch does. Ranks beyond the mesh's size
    are outside it (``get_coordinate()`` None).

    Args:
        device_type: ``"cpu"`` or ``"cuda"``, without an index.
        mesh_shape: positive ints whose product is at most the world size.
        mesh_dim_names: a unique name per dimension.
        backend_override: ``{dimension index or name: backend or (backend, options)}``
            for some dimensions' groups (options are ignored).

    Raises:
        TypeError / ValueError: as :class:`DeviceMesh`, and a shape that is not positive
            ints or is larger than the world; unknown backend_override keys.
    """
    op = "init_device_mesh"
    _check_device_type(device_type, op)
    if not runtime.is_initialized():
        runtime.init_process_group()
    st = runtime.state()
    if (
        isinstance(mesh_shape, (int, np.integer))
        or not isinstance(mesh_shape, Sequence)
        or not mesh_shape
        or any(not isinstance(s, (int, np.integer)) or isinstance(s, bool) or s < 1 for s in mesh_shape)
    ):
        raise ValueError(f"{prefix(op)} mesh_shape must be a non-empty tuple of positive ints, got {mesh_shape!r}")
    shape = tuple(int(s) for s in mesh_shape)
    if math.prod(shape) > st.world_size:
        raise ValueError(
            f"{prefix(op)} mesh_shape {shape} holds {math.prod(shape)} ranks, more than the world size {st.world_size}"
        )
    names = _check_names(mesh_dim_names, len(shape), op)
    overrides = None
    if backend_override is not None:
        overrides = [None] * len(shape)
        for key, value in dict(backend_override).items():
            dim = names.index(key) if names and key in names else key
            if not isinstance(dim, int) or isinstance(dim, bool) or not -len(shape) <= dim < len(shape):
                raise ValueError(
                    f"{prefix(op)} backend_override key {key!r} is neither a dimension index in "
                    f"[0, {len(shape)}) nor one of mesh_dim_names {names}"
                )
            overrides[dim] = value
    return DeviceMesh(
        device_type, np.arange(math.prod(shape)).reshape(shape), mesh_dim_names=names, backend_override=overrides
    )
