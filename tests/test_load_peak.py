"""Loading allocates on the model's device no more than its final weights (1.1x at most): each
tensor is assembled, converted and quantized on the CPU and moved once. The meta device stands
in for a GPU, so that what lands on "the device" is told apart from the CPU's staging."""

import pytest
import torch

from device_allocations import DeviceAllocations, held_bytes
from llama_tp import parallel
from llama_tp.args import ModelArgs
from llama_tp.checkpoint import loading
from llama_tp.quantize import Int4Linear, Int8Linear
from tiny_checkpoint import full_weights, write_checkpoint

META = torch.device("meta")
# Layers wide against a small vocabulary, so that stacking wq/wk/wv and w1/w3 on the device would show.
WIDE_LAYERS = {"dim": 256, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "multiple_of": 64, "norm_eps": 1e-5,
               "rope_theta": 500000.0, "vocab_size": 128}


@pytest.fixture(scope="module")
def two_shards(tmp_path_factory):
    """Two shards loaded into one process: the fused layers are stacked from pieces of both."""
    weights = full_weights(WIDE_LAYERS, WIDE_LAYERS["vocab_size"])
    return write_checkpoint(tmp_path_factory.mktemp("wide"), WIDE_LAYERS, weights, n_shards=2, layout="vocab")


class InThisThread:
    """The loader's thread pool, run in this thread: dispatch modes see one thread's operators."""

    def __init__(self, workers: int):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    map = staticmethod(map)


@pytest.mark.parametrize("dtype, quantize, layer", [
    (torch.float32, None, None), (torch.bfloat16, None, None),
    (torch.bfloat16, "int8", Int8Linear), (torch.bfloat16, "int4", Int4Linear),
])
def test_loading_allocates_only_the_final_weights_on_the_device(two_shards, monkeypatch, dtype, quantize, layer):
    # int4 is refused where no kernel takes it (Llama.build says so up front); here the meta device only counts bytes.
    monkeypatch.setattr(loading, "check_quantize_on", lambda quantize, device: None)
    monkeypatch.setattr(loading, "ThreadPoolExecutor", InThisThread)
    placement = parallel.init()
    on_meta = parallel.Placement(placement.rank, placement.world_size, placement.local_rank, META)
    with DeviceAllocations(META) as allocations:
        model = loading.load_model(two_shards, ModelArgs.from_dict(WIDE_LAYERS), on_meta, dtype, quantize, pack=False)
    weights = held_bytes(model)
    assert all(tensor.device == META for tensor in model.state_dict().values())
    if layer is not None:
        assert isinstance(model.layers[0].attention.wqkv, layer)
    assert 0 < allocations.total <= 1.1 * weights, (allocations.total, weights)


def test_int4_on_a_gpu_without_its_kernel_is_refused_before_loading(checkpoints, monkeypatch, tokenizer_path):
    """Llama.build refuses quantize='int4' (and draft_quantize='int4') on a GPU that torch's int4
    kernel does not run on (compute capability below 8.0) among its argument checks: nothing is
    read or allocated first."""
    from llama_tp import Llama
    from llama_tp.parallel import group

    monkeypatch.setattr(group, "device_for", lambda local_rank: torch.device("cuda", 0))
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (7, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Tesla V100-SXM2-16GB")

    def no_loading(*args, **kwargs):
        raise AssertionError("loading started before the refusal")

    monkeypatch.setattr("llama_tp.generation.load_model", no_loading)
    monkeypatch.setattr("llama_tp.generation.open_checkpoint", no_loading)
    for options in ({"quantize": "int4"}, {"speculate": "draft", "draft_quantize": "int4"}):
        with pytest.raises(ValueError, match="cuda:0 is a Tesla V100-SXM2-16GB of compute capability 7.0"):
            Llama.build(str(checkpoints["llama3", 1]), tokenizer_path, 32, 1, **options)
