"""What the HTTP side reads of a Llama, without its weights: the tokenizer, chat format, reasoning
parser, sampling defaults and the limits requests are checked against. Rank 0 sends it to the
HTTP process (http_process.py) once the model has loaded; there it stands in for the Llama, under
the same attribute names, so that one app serves in either process."""

from dataclasses import dataclass

from ..generation import Llama
from ..model.args import ModelArgs


@dataclass(frozen=True)
class ModelLimits:
    """The sizes of the loaded model that a request must fit (named as Transformer names them)."""

    args: ModelArgs
    max_seq_len: int
    max_batch_size: int
    cache_blocks: int  # the KV cache's blocks: a beam search's must fit them


class ServedModel:
    """A Llama's text side and limits, as the app reads them (app.state.generator)."""

    def __init__(self, generator: Llama):
        self.tokenizer = generator.tokenizer
        self.formatter = generator.formatter
        self.reasoning = generator.reasoning
        self.sampling_defaults = dict(generator.sampling_defaults)
        model = generator.model
        self.model = ModelLimits(model.args, model.max_seq_len, model.max_batch_size, model.cache_blocks)

    # The model's recommended settings where a request leaves them out, chosen as the Llama chooses them
    sampling_options = Llama.sampling_options
