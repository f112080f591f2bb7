"""Multi-host start-up: one JAX process per host, told about the others by the launcher's env.

JAX is multi-controller: every host runs the same program on its own devices, and
``jax.distributed.initialize`` connects them (process 0's address is the coordinator). After
that ``jax.devices()`` lists every device of every host, the mesh spans them all, and XLA's
collectives cross hosts; each process feeds only its own rows of the batch
(``jax.make_array_from_process_local_data``).

Where the process layout comes from, first match wins:

1. JAX's own variables: ``JAX_COORDINATOR_ADDRESS`` (host:port), ``JAX_NUM_PROCESSES``,
   ``JAX_PROCESS_ID``;
2. torchrun / Megatron / cloud-platform variables: ``MASTER_ADDR``, ``MASTER_PORT`` and
   ``NNODES`` + ``NODE_RANK`` or else ``WORLD_SIZE`` + ``RANK``. Under JAX one process drives
   all of a host's accelerators, so a "rank" here is a node: the seed script's
   ``NNODES=${WORLD_SIZE} NODE_RANK=${RANK}`` (platform variables that count nodes) mean
   exactly that. A torchrun with ``--nproc-per-node`` > 1 is refused (``LOCAL_WORLD_SIZE``);
3. SLURM (``SLURM_NTASKS`` > 1 with ``SLURM_PROCID``): ``jax.distributed.initialize()``
   without arguments, which reads SLURM's node list and task ids itself.

With one process configured (or nothing set) nothing is initialised. On the CPU backend the
processes talk through gloo, and each gets ``--cpu-devices`` devices (``jax_num_cpu_devices``):
a real multi-process run on one machine, as the tests do.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping

from mlir_train.runtime import log
from mlir_train.runtime.errors import DistributedEnvError

DEFAULT_PORT = 29500  # torchrun's default MASTER_PORT




@dataclasses.dataclass(frozen=True)
class ProcessLayout:
    num_processes: int
    process_id: int
    coordinator: str | None   # "host:port"; None: let JAX find it (SLURM)
    source: str               # which variables said so, for messages


def _int(env: Mapping[str, str], name: str) -> int:
    value = env[name]
    try:
        return int(value)
    except ValueError:
        raise DistributedEnvError(f"{name}={value!r} is not an integer") from None


def _check(layout: ProcessLayout, count_name: str, id_name: str) -> ProcessLayout:
    n, i = layout.num_processes, layout.process_id
    if n < 1:
        raise DistributedEnvError(f"{count_name}={n}: the number of processes must be at least 1")
    if not 0 <= i < n:
        raise DistributedEnvError(
            f"{id_name}={i} is out of range for {count_name}={n}: process ids run from 0 to {n - 1}")
    return layout


def layout_from_env(env: Mapping[str, str] | None = None) -> ProcessLayout:
    """The process layout the environment describes (single process if it describes none)."""
    env = os.environ if env is None else env
    if "JAX_COORDINATOR_ADDRESS" in env or "JAX_NUM_PROCESSES" in env:
        missing = [k for k in ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID") if k not in env]
        if missing:
            raise DistributedEnvError(f"JAX's multi-process variables are incomplete: {', '.join(missing)} not set")
        return _check(ProcessLayout(_int(env, "JAX_NUM_PROCESSES"), _int(env, "JAX_PROCESS_ID"),
                                    env["JAX_COORDINATOR_ADDRESS"], "JAX_*"),
                      "JAX_NUM_PROCESSES", "JAX_PROCESS_ID")

    count_name, id_name = ("NNODES", "NODE_RANK") if "NNODES" in env else ("WORLD_SIZE", "RANK")
    if count_name in env:
        n = _int(env, count_name)
        if n > 1:
            if int(env.get("LOCAL_WORLD_SIZE", "1") or 1) > 1:
                raise DistributedEnvError(
                    f"LOCAL_WORLD_SIZE={env['LOCAL_WORLD_SIZE']}: JAX runs one process per host that drives "
                    "all of its accelerators; launch with --nproc-per-node 1 (or set NNODES/NODE_RANK to count nodes)")
            if id_name not in env:
                raise DistributedEnvError(f"{count_name}={n} but {id_name} is not set: every process needs its rank")
            if "MASTER_ADDR" not in env:
                raise DistributedEnvError(
                    f"{count_name}={n} but MASTER_ADDR is not set: the processes need process 0's address")
            port = _int(env, "MASTER_PORT") if "MASTER_PORT" in env else DEFAULT_PORT
            if not 0 < port < 65536:
                raise DistributedEnvError(f"MASTER_PORT={port} is not a TCP port")
            layout = ProcessLayout(n, _int(env, id_name), f"{env['MASTER_ADDR']}:{port}", f"{count_name}/{id_name}")
            return _check(layout, count_name, id_name)
        if n < 1:
            raise DistributedEnvError(f"{count_name}={n}: the number of processes must be at least 1")
        if id_name in env and _int(env, id_name) != 0:
            raise DistributedEnvError(f"{id_name}={env[id_name]} is out of range for {count_name}={n}")

    if int(env.get("SLURM_NTASKS", "1") or 1) > 1 and "SLURM_PROCID" in env:
        return _check(ProcessLayout(_int(env, "SLURM_NTASKS"), _int(env, "SLURM_PROCID"), None, "SLURM"),
                      "SLURM_NTASKS", "SLURM_PROCID")
    return ProcessLayout(1, 0, None, "single process")


def initialize_from_env(*, cpu_devices: int | None = None, env: Mapping[str, str] | None = None) -> ProcessLayout:
    """Call ``jax.distributed.initialize`` as the environment says; must run before anything
    touches a JAX device. ``cpu_devices`` (``--cpu-devices``, if set) is the CPU device count per process."""
    import jax

    layout = layout_from_env(env)
    if layout.num_processes == 1:
        return layout
    # Both settings only concern the CPU client, so they are harmless where GPUs run the job;
    # on CPU they make the processes' collectives (gloo) and per-process device count work.
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    if cpu_devices:
        jax.config.update("jax_num_cpu_devices", int(cpu_devices))
    if layout.coordinator is None:
        jax.distributed.initialize()
    else:
        jax.distributed.initialize(coordinator_address=layout.coordinator, num_processes=layout.num_processes,
                                   process_id=layout.process_id)
    log.set_process(jax.process_index())  # from here on only process 0 prints
    return layout


def shutdown(layout: ProcessLayout) -> None:
    if layout.num_processes > 1:
        import jax

        jax.distributed.shutdown()


def barrier(name: str) -> None:
    """Every process waits here until all have arrived (a no-op with one process)."""
    import jax

    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(name)


def from_process_0(value: int) -> int:
    """Process 0's ``value`` on every process, for a decision only process 0 makes (taking the
    ``--save`` lock, verifying a checkpoint's checksums) so that all processes act alike.
    ``value`` itself with one process."""
    import jax

    if jax.process_count() == 1:
        return int(value)
    import numpy as np
    from jax.experimental import multihost_utils

    return int(multihost_utils.broadcast_one_to_all(np.int64(value)))
