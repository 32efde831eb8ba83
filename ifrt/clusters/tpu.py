"""Cloud TPU hosts on GKE: one slice (a multi-host TPU node pool) or several (multislice), one process per host.

Host 1 of slice 1 in a two-slice JobSet ``js`` (replicated Job ``slice``, two hosts per slice) has:

    TPU_WORKER_ID=1 TPU_WORKER_HOSTNAMES=js-slice-1-0.js,js-slice-1-1.js
    MEGASCALE_SLICE_ID=1 MEGASCALE_NUM_SLICES=2 MEGASCALE_COORDINATOR_ADDRESS=js-slice-0-0.js

GKE's TPU webhook sets TPU_WORKER_ID (the pod's completion index) and TPU_WORKER_HOSTNAMES (the slice's hosts in
worker-id order) in Indexed Jobs with a subdomain that request ``google.com/tpu``; JobSet's webhook adds the
MEGASCALE_* variables (jobset's pkg/util/accelerator/tpu.go: the coordinator is pod 0 of job 0,
``<jobset>-<job>-0-0.<subdomain>``, the slice id the job index, the slice count the replicas).
TPU_PROCESS_ADDRESSES ("host:port,...", one entry per process) is preferred over TPU_WORKER_HOSTNAMES when both are
set, as JAX does (jax/_src/clusters/cloud_tpu_cluster.py).

As in JAX: process id = TPU_WORKER_ID + MEGASCALE_SLICE_ID x hosts per slice, process count = hosts per slice x
MEGASCALE_NUM_SLICES, the coordinator MEGASCALE_COORDINATOR_ADDRESS (the slice-0 host 0), else the slice's first
host, at DEFAULT_PORT or IFRT_COORDINATOR_PORT. The slice id is reported as the slice index. Without MEGASCALE_*
variables the job is one slice (slice 0 of 1).
"""

from __future__ import annotations

from collections.abc import Mapping

from ifrt.clusters.base import ClusterEnvironment, Detected, EnvReader, host_of

WORKER_ID_ENV = "TPU_WORKER_ID"  # "1": this host in its slice, 0 to hosts - 1
WORKER_HOSTNAMES_ENV = "TPU_WORKER_HOSTNAMES"  # "js-slice-1-0.js,js-slice-1-1.js" (or "localhost" on one host)
PROCESS_ADDRESSES_ENV = "TPU_PROCESS_ADDRESSES"  # "10.0.0.2:8471,10.0.0.3:8471": one entry per process
SLICE_ID_ENV = "MEGASCALE_SLICE_ID"  # "1": this slice, 0 to slices - 1
NUM_SLICES_ENV = "MEGASCALE_NUM_SLICES"  # "2"
COORDINATOR_ENV = "MEGASCALE_COORDINATOR_ADDRESS"  # "js-slice-0-0.js", sometimes with a port ("10.0.0.2:8080")

_LIST_EXPECTED = "comma-separated host names or host:port addresses, such as 'js-slice-0-0.js,js-slice-0-1.js'"


class GkeTpu(ClusterEnvironment):
    """Present when TPU_WORKER_ID and a host list (TPU_PROCESS_ADDRESSES or TPU_WORKER_HOSTNAMES) are set."""

    name = "tpu"
    priority = 18

    @classmethod
    def is_present(cls, env: Mapping[str, str]) -> bool:
        """The variables libtpu itself needs on a multi-host slice."""
        return WORKER_ID_ENV in env and (PROCESS_ADDRESSES_ENV in env or WORKER_HOSTNAMES_ENV in env)

    @classmethod
    def detect(cls, env: Mapping[str, str]) -> Detected:
        """The id within the slice plus the slice's offset, the hosts of all slices, and slice 0's host 0."""
        r = EnvReader(env, cls.name)
        list_env, raw_list = r.first(PROCESS_ADDRESSES_ENV, WORKER_HOSTNAMES_ENV)
        assert list_env is not None and raw_list is not None
        hosts = [host_of(entry) for entry in raw_list.split(",")]
        if not hosts or None in hosts:
            raise r.error(list_env, raw_list, _LIST_EXPECTED)
        worker = r.integer(WORKER_ID_ENV, required=True)
        assert worker is not None
        if worker >= len(hosts):
            raise r.error(WORKER_ID_ENV, env[WORKER_ID_ENV], f"a worker id below the {len(hosts)} hosts of "
                                                             f"{list_env}={raw_list!r}")
        slice_id = r.integer(SLICE_ID_ENV, field="slice_index")
        slices = r.integer(NUM_SLICES_ENV, minimum=1)
        if slice_id is not None and slice_id >= (slices or 1):
            raise r.error(SLICE_ID_ENV, env[SLICE_ID_ENV], f"a slice id below {NUM_SLICES_ENV}="
                                                           f"{env.get(NUM_SLICES_ENV, '1 (unset)')!r}")
        per_slice, slice_id, slices = len(hosts), slice_id or 0, slices or 1
        r.note("process_id", f"{WORKER_ID_ENV}={env[WORKER_ID_ENV]!r}"
               + (f" + {SLICE_ID_ENV}={env[SLICE_ID_ENV]!r} x {per_slice} hosts" if SLICE_ID_ENV in env else ""))
        r.note("num_processes", f"{per_slice} hosts in {list_env}" + (f" x {NUM_SLICES_ENV}={env[NUM_SLICES_ENV]!r}"
                                                                       if NUM_SLICES_ENV in env else ""))
        if r.get(COORDINATOR_ENV):
            host = r.address(COORDINATOR_ENV)
        else:
            host = hosts[0]
            r.note("coordinator", f"{list_env}={raw_list!r}")
        assert host is not None
        return r.detected(
            coordinator=r.coordinator(host),
            process_id=worker + slice_id * per_slice,
            num_processes=per_slice * slices,
            slice_index=slice_id,
        )
