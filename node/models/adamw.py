"""The run's AdamW: torch's fused AdamW kernel (`torch._fused_adamw_`, the arithmetic of
`torch.optim.AdamW(fused=True)`), driven by a small optimizer of our own.

Why not `torch.optim.AdamW` itself: building any `torch.optim.Optimizer` imports torch._dynamo
(its `add_param_group` is wrapped to keep the compiler out), about two seconds of CPU in every
process that trains, for nothing we use. This class keeps what the roles use of an optimizer —
`param_groups` (whose "lr" the schedule sets), `step()`, `zero_grad()`, and `state_dict()` /
`load_state_dict()` in torch's layout, so a checkpoint saved by either loads into the other.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch

GROUP_DEFAULTS = {"amsgrad": False, "foreach": None, "maximize": False, "capturable": False, "differentiable": False, "fused": True,
                  "decoupled_weight_decay": True}  # fmt: skip (as torch.optim.AdamW(fused=True) writes them into a state dict)


def fused_supported(params: Iterable[torch.Tensor]) -> bool:
    """Whether torch has the fused kernel for every parameter's device and dtype."""
    from torch.optim.optimizer import _get_fused_kernels_supported_devices  # (no torch._dynamo in this import)

    devices = _get_fused_kernels_supported_devices()
    return hasattr(torch, "_fused_adamw_") and all(p.device.type in devices and torch.is_floating_point(p) for p in params)


class FusedAdamW:
    """AdamW over parameter groups, one fused kernel call per group and step."""

    def __init__(self, groups: list[dict], lr: float, betas: tuple[float, float], eps: float = 1e-8, weight_decay: float = 1e-2):
        defaults = {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay, **GROUP_DEFAULTS}
        self.param_groups = [{**defaults, **g, "params": list(g["params"])} for g in groups]
        self.state: dict[torch.Tensor, dict[str, torch.Tensor]] = {}

    def zero_grad(self, set_to_none: bool = True) -> None:
        for g in self.param_groups:
            for p in g["params"]:
                if set_to_none:
                    p.grad = None
                elif p.grad is not None:
                    p.grad.detach_().zero_()

    @torch.no_grad()
    def step(self) -> None:
        for g in self.param_groups:
            params = [p for p in g["params"] if p.grad is not None]
            if not params:
                continue
            states = [self._state(p) for p in params]
            steps = [s["step"] for s in states]
            torch._foreach_add_(steps, 1)
            beta1, beta2 = g["betas"]
            torch._fused_adamw_(
                params, [p.grad for p in params], [s["exp_avg"] for s in states], [s["exp_avg_sq"] for s in states], [], steps,
                amsgrad=False, lr=g["lr"], beta1=beta1, beta2=beta2, weight_decay=g["weight_decay"], eps=g["eps"], maximize=False,
                grad_scale=None, found_inf=None,
            )  # fmt: skip

    def _state(self, p: torch.Tensor) -> dict[str, torch.Tensor]:
        s = self.state.get(p)
        if s is None:  # as torch's fused AdamW starts a parameter: a float32 step on its device, zero moments
            s = self.state[p] = {"step": torch.zeros((), dtype=torch.float32, device=p.device),
                                 "exp_avg": torch.zeros_like(p, memory_format=torch.preserve_format),
                                 "exp_avg_sq": torch.zeros_like(p, memory_format=torch.preserve_format)}  # fmt: skip
        return s

    def state_dict(self) -> dict[str, Any]:
        """torch's layout: parameters by their index over the groups, in order."""
        index = {id(p): i for i, p in enumerate(p for g in self.param_groups for p in g["params"])}
        groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": [index[id(p)] for p in g["params"]]} for g in self.param_groups]
        return {"state": {index[id(p)]: dict(s) for p, s in self.state.items()}, "param_groups": groups}

    def load_state_dict(self, saved: Mapping[str, Any]) -> None:
        """A state in torch's layout (ours, or torch.optim.AdamW's): the same groups and sizes."""
        groups = saved["param_groups"]
        if len(groups) != len(self.param_groups) or any(len(a["params"]) != len(b["params"]) for a, b in zip(groups, self.param_groups)):
            raise ValueError("the saved optimizer state has other parameter groups than this optimizer")
        by_index = {i: p for a, b in zip(groups, self.param_groups) for i, p in zip(a["params"], b["params"])}
        for a, b in zip(groups, self.param_groups):
            b.update({k: v for k, v in a.items() if k not in ("params", "fused")})  # (the kernel stays this one's)
        self.state = {}
        for i, s in saved["state"].items():
            p = by_index[int(i)]
            self.state[p] = {"step": torch.as_tensor(s["step"], dtype=torch.float32).to(p.device).reshape(()),
                             "exp_avg": s["exp_avg"].to(device=p.device, dtype=p.dtype),
                             "exp_avg_sq": s["exp_avg_sq"].to(device=p.device, dtype=p.dtype)}  # fmt: skip
