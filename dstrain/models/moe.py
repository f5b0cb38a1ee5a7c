"""Mixture-of-experts models while they train: the router's load-balancing loss and the experts' load.

The balancing loss is transformers' own: a MoE model whose config sets `output_router_logits` (model.kwargs
`output_router_logits: true`) returns `aux_loss` from its forward, and its loss with labels is the LM loss
plus `router_aux_loss_coef` times it. dstrain's CausalLM adds it in the same way where it computes the LM
loss itself (batches of (inputs, targets)); RouterStats keeps both parts apart for the log.

The experts' load is counted where transformers hands each MoE layer's experts module the top-k expert of
every token (`experts(hidden_states, top_k_index, top_k_weights)`, the same call in Qwen2/3-MoE, Mixtral,
DeepSeek-V3, gpt-oss, OLMoE): a forward pre-hook adds up the tokens each expert got, on the device, with no
sync. At log steps `reduce` sums them over the ranks (a collective every rank calls) and gives
`expert_load`: the busiest expert's tokens over the mean, in the worst layer (1.0: perfectly balanced;
top_k * ... : every token to the same experts), with `expert_tokens` (per expert, summed over the layers)
for metrics.jsonl.
"""

from __future__ import annotations

import torch
from torch import nn


def experts_modules(model: nn.Module) -> dict[str, nn.Module]:
    """The MoE layers' experts modules of a transformers model (fused 3-D expert weights, `num_experts`)."""
    return {name: module for name, module in model.named_modules()
            if isinstance(getattr(module, "num_experts", None), int) and hasattr(module, "down_proj")
            and isinstance(getattr(module, "down_proj"), nn.Parameter)}


def experts_per_token(model: nn.Module) -> int | None:
    """How many routed experts each token goes to (the config's num_experts_per_tok or its older names)."""
    config = getattr(model, "config", None)
    config = getattr(config, "text_config", None) or config  # a multimodal model's language side
    for name in ("num_experts_per_tok", "moe_topk", "top_k", "num_selected_experts"):
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def inactive_parameters(model: nn.Module) -> int:
    """The routed experts' parameters a token does not use: in every MoE layer, (E - k) / E of its experts
    module's parameters, with E experts and k per token. 0 for a dense model. Shared experts and the router
    run for every token and count as active. Works on the meta device and on ZeRO-3 partitions."""
    top_k = experts_per_token(model)
    if top_k is None:
        return 0
    inactive = 0
    for module in experts_modules(model).values():
        experts = module.num_experts
        numel = sum(getattr(p, "ds_numel", p.numel()) for p in module.parameters())
        inactive += numel * max(experts - top_k, 0) // experts
    return inactive


def aux_loss_coef(model: nn.Module) -> float | None:
    """router_aux_loss_coef where the model's config asks for the balancing loss (output_router_logits),
    else None."""
    config = getattr(model, "config", None)
    if config is None or not getattr(config, "output_router_logits", False):
        return None
    return float(getattr(config, "router_aux_loss_coef", 0.0) or 0.0)


class RouterStats:
    """The balancing loss and the tokens per expert since the last log line, as device tensors."""

    def __init__(self, model: nn.Module, device: torch.device | None = None):
        self.layers = experts_modules(model)
        self.coef = aux_loss_coef(model)
        self.device = device
        self._counts: dict[str, torch.Tensor] = {}
        self._aux = None
        self._lm = None
        self._forwards = 0
        for name, module in self.layers.items():
            module.register_forward_pre_hook(self._counter(name, module.num_experts))

    def __bool__(self) -> bool:
        return bool(self.layers)

    def _counter(self, name: str, experts: int):
        def count(module, args):
            if not module.training or len(args) < 2 or not isinstance(args[1], torch.Tensor) or args[1].is_floating_point():
                return
            if torch._C._current_graph_task_id() != -1:  # a backward's recomputation (activation checkpointing)
                return
            tokens = torch.bincount(args[1].reshape(-1), minlength=experts)[:experts]
            if name in self._counts:
                self._counts[name] += tokens
            else:
                self._counts[name] = tokens.clone()
        return count

    def add_losses(self, total: torch.Tensor, aux: torch.Tensor | None, training: bool = True) -> None:
        """One training forward's loss (the LM loss plus coef x aux where it counts) and its balancing loss."""
        if aux is None or self.coef is None or not training:
            return
        aux = aux.detach().float()
        lm = total.detach().float() - self.coef * aux
        self._aux = aux if self._aux is None else self._aux + aux
        self._lm = lm if self._lm is None else self._lm + lm
        self._forwards += 1

    def reset(self) -> None:
        self._counts.clear()
        self._aux = self._lm = None
        self._forwards = 0

    def reduce(self, group=None) -> dict:
        """The log line's MoE values over all ranks (a collective: every rank calls it), then a fresh window:
        lm_loss and aux_loss (the mean per forward, where the balancing loss counts), expert_load (the busiest
        expert's tokens over the mean, worst layer) and expert_tokens (per expert, summed over the layers)."""
        import torch.distributed as dist
        names = sorted(self.layers)
        experts = max(module.num_experts for module in self.layers.values())
        device = self.device or (next(iter(self._counts.values())).device if self._counts else "cpu")
        counts = torch.zeros(len(names), experts, device=device, dtype=torch.float64)
        for row, name in enumerate(names):
            if name in self._counts:
                counts[row, :self._counts[name].numel()] = self._counts[name].to(counts.dtype)
        losses = torch.tensor([0.0, 0.0, float(self._forwards)], device=device, dtype=torch.float64)
        if self._forwards:
            losses[0], losses[1] = self._lm.double().to(device), self._aux.double().to(device)
        if dist.is_initialized():
            dist.all_reduce(counts, group=group)
            dist.all_reduce(losses, group=group)
        self.reset()
        values: dict = {}
        if losses[2] > 0:
            values["lm_loss"] = float(losses[0] / losses[2])
            values["aux_loss"] = float(losses[1] / losses[2])
        routed = counts.sum(dim=1)
        if bool((routed > 0).any()):
            widths = torch.tensor([self.layers[n].num_experts for n in names], device=device, dtype=counts.dtype)
            means = routed / widths
            used = routed > 0
            values["expert_load"] = float((counts.max(dim=1).values[used] / means[used]).max())
            values["expert_tokens"] = [int(v) for v in counts.sum(dim=0).tolist()]
        return values
