"""A small mixture-of-experts feed-forward block: a top-k router over grouped experts.

Plain PyTorch, written so expert parallelism can split it (``hp_lightning.ExpertParallel``, or
``HSDPStrategy(expert_parallel_size=E)``, which finds the ``experts`` modules):

* :class:`GroupedExperts` stacks every expert's weights on a leading experts dim and takes the
  tokens sorted by expert plus the count per expert. Its forward derives the number of experts
  from its weights, so the same code runs on all experts (one process) or on the ``m`` experts an
  EP rank holds (the tokens then arrive already dispatched);
* :class:`MoE` routes each token to its ``top_k`` experts (softmax weights over the chosen
  ones), sorts the (token, expert) pairs by expert, calls the experts once, and sums the weighted
  outputs back per token.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn


class GroupedExperts(nn.Module):
    """``num_experts`` two-layer GELU MLPs, weights stacked as ``[num_experts, ...]``."""

    def __init__(self, dim: int, hidden: int, num_experts: int) -> None:
        super().__init__()
        self.w_in = nn.Parameter(torch.empty(num_experts, dim, hidden))
        self.w_out = nn.Parameter(torch.empty(num_experts, hidden, dim))
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        nn.init.normal_(self.w_in, std=0.02)
        nn.init.normal_(self.w_out, std=0.02 / math.sqrt(2))

    def forward(self, tokens: Tensor, num_tokens_per_expert: Tensor) -> Tensor:
        """``tokens`` ``[N, dim]`` sorted by expert, ``num_tokens_per_expert`` ``[experts]`` → ``[N, dim]``."""
        counts = num_tokens_per_expert.tolist()
        outputs = [
            F.gelu(chunk @ self.w_in[e]) @ self.w_out[e] for e, chunk in enumerate(torch.split(tokens, counts, dim=0))
        ]
        return torch.cat(outputs, dim=0) if outputs else tokens.new_zeros((0, self.w_out.shape[-1]))


class MoE(nn.Module):
    """Top-k mixture of experts: ``router`` (a Linear) and ``experts`` (:class:`GroupedExperts`)."""

    def __init__(self, dim: int, hidden: int, num_experts: int, top_k: int = 2) -> None:
        super().__init__()
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"MoE(top_k=...) expects 1 <= top_k <= num_experts={num_experts}; got {top_k!r}.")
        self.top_k = top_k
        self.num_experts = num_experts
        self.router = nn.Linear(dim, num_experts, bias=False)
        self.experts = GroupedExperts(dim, hidden, num_experts)

    def forward(self, x: Tensor) -> Tensor:
        shape = x.shape
        tokens = x.reshape(-1, shape[-1])
        scores, chosen = torch.topk(self.router(tokens), self.top_k, dim=-1)  # [T, k]
        weights = F.softmax(scores, dim=-1)
        expert_ids = chosen.reshape(-1)  # one (token, expert) pair per entry
        order = torch.argsort(expert_ids, stable=True)
        counts = torch.bincount(expert_ids, minlength=self.num_experts)
        routed = self.experts(tokens[order // self.top_k], counts)
        per_pair = torch.empty_like(routed).index_copy(0, order, routed)
        combined = (per_pair.view(-1, self.top_k, shape[-1]) * weights.unsqueeze(-1)).sum(dim=1)
        return combined.view(shape)
