"""The feed-forward of a layer: Llama's SwiGLU, or a mixture of SwiGLU experts split over the
ranks as Meta's Llama 4 reference splits it.

In a mixture of experts (Mixtral, Qwen3-MoE, Llama 4) the router is whole on every rank, and
every expert's hidden size is split across the model-parallel ranks, as a dense SwiGLU's is: each
rank holds every expert's slice. The routed experts' and the shared expert's partial outputs are
summed on each rank, then all-reduced once for the layer.

Each token goes through its chosen experts only: its (token, expert) pairs are sorted by expert
and each expert multiplies all of its tokens in one product (grouped products, as vLLM's fused
MoE and llama.cpp do), where the reference runs every token through every expert (16x the work
for Llama 4 Scout, 128x for Maverick). How many tokens each expert takes is read back to the
host to split the sorted pairs: under torch.compile that part runs eagerly (routed_experts), and
such models decode without CUDA graphs (Transformer.setup_caches).
"""

import torch
import torch.nn.functional as F
from torch import nn

from ..kernels import matmul
from ..parallel import all_reduce, column_parallel_linear, row_parallel_linear
from .args import ModelArgs


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x), with w1 and w3 held side by side as one weight.

    reduce=False leaves w2's output as this rank's partial sum (an expert's, summed by its layer)."""

    FUSED = ("w13", ("w1", "w3"))

    def __init__(self, dim: int, hidden_dim: int, model_parallel_size: int, reduce: bool = True):
        super().__init__()
        self.local_widths = 2 * (hidden_dim // model_parallel_size,)
        self.w13 = column_parallel_linear(dim, 2 * hidden_dim, gather_output=False)
        self.w2 = row_parallel_linear(hidden_dim, dim, reduce=reduce)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.w13(x).split(self.local_widths, dim=-1)
        return self.w2(F.silu(gate) * up)


class Router(nn.Module):
    """The logits of every expert for each token, [tokens, experts]: a linear layer whole on every
    rank, kept in the model's dtype when the experts are quantized (as llama.cpp keeps it)."""

    def __init__(self, dim: int, n_experts: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(n_experts, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return matmul.linear(x, self.weight)


def route(logits: torch.Tensor, k: int, scoring: str, normalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's k experts and their weights from router logits [tokens, experts]: weights
    [tokens, k] in fp32 and expert ids [tokens, k].

    softmax: the probabilities over every expert, the k largest (rescaled to sum to 1 with
    normalize), as Mixtral and Qwen3-MoE route. sigmoid: the k largest logits, each through a
    sigmoid, as Llama 4 routes."""
    if scoring == "sigmoid":
        top, experts = logits.topk(k, dim=-1)
        return torch.sigmoid(top.float()), experts
    weights, experts = logits.float().softmax(dim=-1).topk(k, dim=-1)
    if normalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, experts


class MixtureOfExperts(nn.Module):
    """A router, n_experts SwiGLU experts (each rank holding its slice of every one) and, with
    args.shared_expert, one that every token goes through; one all-reduce for all of them."""

    def __init__(self, args: ModelArgs, model_parallel_size: int):
        super().__init__()
        self.experts_per_token, self.scoring = args.experts_per_token, args.router_scoring
        self.normalize, self.weights_on_input = args.normalize_expert_weights, args.expert_weights_on_input
        self.router = Router(args.dim, args.n_experts)
        self.experts = nn.ModuleList(FeedForward(args.dim, args.expert_hidden_dim, model_parallel_size, reduce=False)
                                     for _ in range(args.n_experts))
        self.shared_expert = (FeedForward(args.dim, args.expert_hidden_dim, model_parallel_size, reduce=False)
                              if args.shared_expert else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = x.reshape(-1, x.shape[-1])  # bsz * seqlen, dim
        weights, experts = route(self.router(tokens), self.experts_per_token, self.scoring, self.normalize)
        out = self.routed(tokens, weights, experts)
        if self.shared_expert is not None:
            out = out + self.shared_expert(tokens)
        return all_reduce(out).view(x.shape)

    @torch.compiler.disable  # the experts' token counts decide the products' shapes: eager under compile
    def routed(self, tokens: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        """The weighted sum of each token's experts' outputs (this rank's part), [tokens, dim]:
        the (token, expert) pairs sorted by expert, each expert's tokens in one product."""
        n_tokens, k = experts.shape
        pairs = experts.flatten()  # pair p is token p // k's p % k-th choice
        order = pairs.argsort(stable=True)
        counts = torch.bincount(pairs, minlength=len(self.experts)).tolist()  # the step's one read-back
        inputs = tokens.index_select(0, order // k)  # tokens * k, dim: grouped by expert
        if self.weights_on_input:
            inputs = inputs * weights.flatten()[order, None].to(inputs.dtype)
        outputs = torch.cat([self.experts[expert](group)
                             for expert, group in enumerate(inputs.split(counts)) if len(group)])
        by_pair = torch.empty_like(outputs).index_copy_(0, order, outputs).view(n_tokens, k, -1)
        if self.weights_on_input:
            return by_pair.sum(dim=1)
        # Each token's k outputs summed in its own order, whatever else is in the batch.
        return (by_pair.float() * weights[..., None]).sum(dim=1).to(tokens.dtype)
