"""Which device a process takes (parallel.group.device_for), with the GPU count faked: the CUDA
path's choices checked on a machine without one."""

import pytest
import torch

from llama_tp.parallel import group


@pytest.fixture
def gpus(monkeypatch):
    """Pretend CUDA sees `count` GPUs."""
    def pretend(count: int) -> None:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: count > 0)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    monkeypatch.delenv("LLAMA_TP_DEVICE", raising=False)
    return pretend


def test_one_visible_gpu_is_cuda_0_whatever_the_local_rank(gpus, monkeypatch):
    gpus(1)  # SLURM or Kubernetes: each process sees its own GPU
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert group.device_for(3) == torch.device("cuda", 0)


def test_each_local_rank_takes_its_own_gpu(gpus, monkeypatch):
    gpus(4)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert [group.device_for(rank) for rank in range(4)] == [torch.device("cuda", rank) for rank in range(4)]


@pytest.mark.parametrize("local_rank", [0, 2])
def test_more_processes_than_gpus_is_refused_on_every_rank(gpus, monkeypatch, local_rank):
    gpus(2)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "3")
    with pytest.raises(ValueError, match=r"runs 3 processes but shows 2 GPUs.*--nproc_per_node 2.*LLAMA_TP_DEVICE=cpu"):
        group.device_for(local_rank)


def test_a_local_rank_without_a_gpu_is_refused_without_local_world_size(gpus, monkeypatch):
    gpus(2)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    with pytest.raises(ValueError, match="LOCAL_RANK 2"):
        group.device_for(2)


def test_llama_tp_device_cpu_runs_on_cpu_beside_gpus(gpus, monkeypatch):
    gpus(8)
    monkeypatch.setenv("LLAMA_TP_DEVICE", "cpu")
    assert not group.accelerator_available()
    assert group.device_for(0) == torch.device("cpu")


def test_llama_tp_device_cuda_without_a_gpu_is_refused(gpus, monkeypatch):
    gpus(0)
    monkeypatch.setenv("LLAMA_TP_DEVICE", "cuda")
    with pytest.raises(ValueError, match="CUDA sees no GPU"):
        group.device_for(0)


def test_no_gpu_means_cpu(gpus):
    gpus(0)
    assert group.device_for(0) == torch.device("cpu")


def test_an_unknown_llama_tp_device_is_refused(monkeypatch):
    monkeypatch.setenv("LLAMA_TP_DEVICE", "gpu")
    with pytest.raises(ValueError, match="LLAMA_TP_DEVICE='gpu' is not one of auto, cpu, cuda"):
        group.device_for(0)


def test_ranks_share_gpus_through_gloo(gpus, monkeypatch):
    gpus(2)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    monkeypatch.setenv("LLAMA_TP_BACKEND", "gloo")
    assert [group.device_for(rank) for rank in range(4)] == [torch.device("cuda", rank % 2) for rank in range(4)]
    assert group.backend_for(torch.device("cuda", 0)) == "gloo"


def test_more_processes_than_gpus_names_the_gloo_backend_as_a_way_out(gpus, monkeypatch):
    gpus(2)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "3")
    with pytest.raises(ValueError, match="set LLAMA_TP_BACKEND=gloo to share GPUs"):
        group.device_for(0)


@pytest.mark.parametrize("requested, device, backend", [
    (None, "cuda", "nccl"), ("auto", "cuda", "nccl"), ("NCCL", "cuda", "nccl"), ("gloo", "cuda", "gloo"),
    (None, "cpu", "gloo"), ("gloo", "cpu", "gloo"),
])
def test_the_backend_is_nccl_on_gpus_unless_gloo_is_asked_for(monkeypatch, requested, device, backend):
    if requested is None:
        monkeypatch.delenv("LLAMA_TP_BACKEND", raising=False)
    else:
        monkeypatch.setenv("LLAMA_TP_BACKEND", requested)
    assert group.backend_for(torch.device(device)) == backend


def test_nccl_on_the_cpu_is_refused(monkeypatch):
    monkeypatch.setenv("LLAMA_TP_BACKEND", "nccl")
    with pytest.raises(ValueError, match="LLAMA_TP_BACKEND=nccl needs GPUs, but this job runs on the CPU"):
        group.backend_for(torch.device("cpu"))


def test_an_unknown_backend_is_refused(monkeypatch):
    monkeypatch.setenv("LLAMA_TP_BACKEND", "mpi")
    with pytest.raises(ValueError, match="LLAMA_TP_BACKEND='mpi' is not one of auto, nccl, gloo"):
        group.backend_for(torch.device("cuda", 0))


@pytest.mark.parametrize("capability, dtype", [((7, 0), torch.float16), ((7, 5), torch.float16),
                                               ((8, 0), torch.bfloat16), ((9, 0), torch.bfloat16)])
def test_gpus_that_only_emulate_bf16_get_fp16(monkeypatch, capability, dtype):
    """V100 (7.0) and T4 (7.5): torch.cuda.is_bf16_supported() says yes (emulation), fp16 it is."""
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: including_emulation
                        or capability >= (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    assert group.resolve_dtype(None, torch.device("cuda", 0)) == dtype
    assert group.resolve_dtype("bf16", torch.device("cuda", 0)) == torch.bfloat16  # as asked, though


@pytest.mark.parametrize("backend, world_size, graphs", [("nccl", 2, True), ("gloo", 1, True), ("gloo", 2, False)])
def test_cuda_graphs_only_where_they_can_hold_the_collectives(monkeypatch, backend, world_size, graphs):
    """gloo's collectives on CUDA tensors copy through the host, which a graph capture refuses."""
    monkeypatch.setattr(group.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(group.dist, "get_world_size", lambda group=None: world_size)
    monkeypatch.setattr(group.dist, "get_backend", lambda group=None: backend)
    assert group.decode_compilation(torch.device("cuda", 0)).graphs == graphs
