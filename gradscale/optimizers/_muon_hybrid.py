"""The Muon hybrid's composite optimizer (the entry is muon.py). A module of its own because it imports torch:
the registry skips modules whose names start with an underscore, and muon.py's builder imports this one."""

from __future__ import annotations

import torch


class MuonHybrid(torch.optim.Optimizer):
    """Muon (torch.optim.Muon) on the hidden matrices, AdamW (foreach, as optimizer=adamw) on every other
    parameter, as one optimizer. Its param_groups are the parts' (Muon's first) and its state is one dict
    that both parts write to, so checkpoints, the Adam statistics (adam_moments reads the groups with betas
    and eps: the AdamW part's) and the histograms see its groups like any optimizer's."""

    def __init__(self, matrices: list, others: list, muon: dict, adamw: dict):
        self.parts = []
        if matrices:
            self.parts.append(torch.optim.Muon(matrices, **muon))
        if others:
            self.parts.append(torch.optim.AdamW(others, foreach=True, **adamw))
        super().__init__([group for part in self.parts for group in part.param_groups], defaults={})
        self._share()

    def _share(self) -> None:
        start = 0
        for part in self.parts:
            part.param_groups = self.param_groups[start:start + len(part.param_groups)]
            part.state = self.state
            start += len(part.param_groups)

    @torch.no_grad()
    def step(self, closure=None):
        if closure is not None:
            raise ValueError("MuonHybrid.step takes no closure")
        for part in self.parts:
            part.step()

    def load_state_dict(self, state_dict: dict) -> None:
        super().load_state_dict(state_dict)  # new group dicts and a new state dict: the parts follow them
        self._share()
