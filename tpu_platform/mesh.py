"""The device mesh an engine runs on: axes ("data", "model") over the local devices.

``--tensor-parallel-size N --data-parallel-size M`` lays the first N*M local devices out as an
[M, N] grid. Each data-parallel replica is one engine over one row of it: a (1, N) mesh whose
"model" axis splits weights and KV heads (tensor parallel, ``models/sharding.py``), while the
replicas never talk to each other (``server/data_parallel.py`` routes requests between them).
Over several hosts (``multihost.py``) every replica's TP group spans all of them (``mesh_devices``).

Axes are ``Auto`` (GSPMD picks the collectives for the sharded matmuls): ``jax.make_mesh`` defaults
to Explicit axes in jax 0.10, under which a row-parallel matmul is a sharding type error.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from tpuserve.tpu_platform.config import ConfigError

DATA_AXIS = "data"
MODEL_AXIS = "model"


@dataclass(frozen=True)
class MeshPlan:
    """Which devices each replica uses. ``rows[i]`` are replica i's TP devices, in mesh order."""

    tensor_parallel_size: int
    data_parallel_size: int
    rows: tuple[tuple, ...]


def plan_devices(tensor_parallel_size: int, data_parallel_size: int = 1, devices=None) -> MeshPlan:
    """Split the local devices into ``data_parallel_size`` groups of ``tensor_parallel_size``.

    Raises ConfigError when there are too few devices (naming both flags and the device count).
    """
    import jax

    tp, dp = int(tensor_parallel_size), int(data_parallel_size)
    devices = list(jax.local_devices() if devices is None else devices)
    need = tp * dp
    if need > len(devices):
        platform = getattr(devices[0], "platform", "?") if devices else "?"
        hint = (
            " (on CPU, XLA_FLAGS=--xla_force_host_platform_device_count=N before JAX starts "
            "gives N fake devices)"
            if platform == "cpu"
            else ""
        )
        raise ConfigError(
            f"tensor_parallel_size={tp} x data_parallel_size={dp} needs {need} devices, "
            f"but this host has {len(devices)} {platform} device(s){hint}"
        )
    grid = np.empty((dp, tp), dtype=object)
    for i, d in enumerate(devices[:need]):
        grid[i // tp, i % tp] = d
    return MeshPlan(tp, dp, tuple(tuple(row) for row in grid))


def replica_mesh(plan: MeshPlan, replica: int = 0):
    """The (data=1, model=TP) mesh of one data-parallel replica."""
    from jax.sharding import Mesh

    if not 0 <= replica < plan.data_parallel_size:
        raise ValueError(f"replica {replica} out of range [0, {plan.data_parallel_size})")
    row = np.empty((1, plan.tensor_parallel_size), dtype=object)
    row[0, :] = plan.rows[replica]
    return Mesh(row, (DATA_AXIS, MODEL_AXIS))


def build_mesh(tensor_parallel_size: int, data_parallel_size: int = 1, replica: int = 0, devices=None):
    """Shortcut: the mesh of replica ``replica`` under ``plan_devices``."""
    return replica_mesh(plan_devices(tensor_parallel_size, data_parallel_size, devices), replica)


def model_axis_size(mesh) -> int:
    """TP degree of ``mesh`` (1 for None: no mesh, a single device)."""
    return 1 if mesh is None else int(mesh.shape[MODEL_AXIS])


def mesh_devices(tensor_parallel_size: int, num_hosts: int, data_parallel_size: int = 1) -> list:
    """The devices of TP groups spanning every host, replica by replica: replica r takes local
    devices [r*TP/H, (r+1)*TP/H) of each process, host by host (neighbours on one host stay
    neighbours on the "model" axis). ``plan_devices`` then cuts the list into replicas of TP."""
    import jax

    per_host = tensor_parallel_size // num_hosts
    need = per_host * data_parallel_size
    local = []
    for p in range(num_hosts):
        mine = sorted((d for d in jax.devices() if d.process_index == p), key=lambda d: d.id)
        if len(mine) < need:
            dp = f" x data_parallel_size={data_parallel_size}" if data_parallel_size > 1 else ""
            raise ConfigError(
                f"tensor_parallel_size={tensor_parallel_size}{dp} over {num_hosts} hosts needs "
                f"{need} devices on each; host {p} has {len(mine)}"
            )
        local.append(mine)
    return [
        d
        for r in range(data_parallel_size)
        for mine in local
        for d in mine[r * per_host : (r + 1) * per_host]
    ]
