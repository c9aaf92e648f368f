"""What the process groups of a job look like from inside one rank: shared by
test_process_groups.py (CPU, gloo) and tests/gpu (NCCL)."""

import os
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from llama_tp import parallel


def group_timeouts(device: torch.device) -> dict[str, float]:
    """Every process group this process belongs to, by name, with its backend's timeout in seconds."""
    timeouts = {}
    for pg in list(c10d._world.pg_map):
        backend = pg._get_backend(device if dist.get_backend(pg) == "nccl" else torch.device("cpu"))
        timeouts[f"{c10d._world.pg_names[pg]} ({dist.get_backend(pg)})"] = backend.options._timeout.total_seconds()
    return timeouts


def joined_with_timeout(seconds: int) -> dict:
    """Join the job with LLAMA_TP_TIMEOUT=seconds; its groups' timeouts, and the groups that
    carried host objects with their backends."""
    os.environ["LLAMA_TP_TIMEOUT"] = str(seconds)
    placement = parallel.init()
    object_groups = []
    originals = dist.all_gather_object, dist.broadcast_object_list

    def recording(original):
        def collective(*args, group=None, **kwargs):
            object_groups.append(dist.get_backend(group))
            return original(*args, group=group, **kwargs)
        return collective

    dist.all_gather_object, dist.broadcast_object_list = map(recording, originals)
    try:
        gathered = parallel.gather_objects({"rank": placement.rank})
        sent = parallel.broadcast_object("from rank 0" if placement.rank == 0 else None)
        with parallel.agreement("checking"):
            parallel.check_same_on_every_rank("the arguments", [1, 2])
        pickles_before_quiet_step = len(object_groups)
        quiet = parallel.gather_objects_if_any("nothing", anything=False)
        pickles_in_quiet_step = len(object_groups) - pickles_before_quiet_step
        news = parallel.gather_objects_if_any(placement.rank, anything=placement.rank == 1)
    finally:
        dist.all_gather_object, dist.broadcast_object_list = originals
    result = {"timeouts": group_timeouts(placement.device), "object_backends": object_groups,
              "gathered": gathered, "sent": sent, "device": str(placement.device),
              "default_backend": dist.get_backend(), "quiet": (quiet, pickles_in_quiet_step), "news": news}
    parallel.leave()
    return result


def expected_timeout(seconds: int) -> float:
    return timedelta(seconds=seconds).total_seconds()
