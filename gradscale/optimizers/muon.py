"""The Muon hybrid, as run in 2026: Muon on the hidden matrices, AdamW on the rest.

Which parameters go where: every 2-D weight of the transformer blocks (attention q/k/v/o, MLP gate/up/down,
and LoRA's A and B under finetune=lora) gets Muon; the embedding / output matrix (tied or not), the norms'
gains and any other parameter get AdamW with its own lr, betas and eps.

Muon's update is Newton-Schulz(bf16(M) / max(||M||_F, eps)) of the (Nesterov) momentum M, whole matrix at
a time: invariant to the gradient's scale while ||M||_F > eps (1e-7), exactly so for powers of two
(the bf16 cast and the norm scale exactly). The AdamW part keeps AdamW's eps: the world-size bug reaches
the hybrid there, on the embedding rows (docs/design.md).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from gradscale.checks import check, check_betas, finite_positive, int_at_least, one_of
from gradscale.optimizers.base import OptimizerConfig, OptimizerEntry, ScaleRule

ADJUST_LR = ("original", "match_rms_adamw")


@dataclass
class MuonConfig(OptimizerConfig):
    name: str = "muon"
    lr: float = 0.02  # Muon's, on the hidden matrices (scaled by adjust_lr_fn per shape)
    momentum: float = 0.95
    nesterov: bool = True
    ns_steps: int = 5
    eps: float = 1e-7  # Muon's clamp on the momentum's Frobenius norm
    adjust_lr_fn: str = "original"  # original: sqrt(max(1, rows / cols)); match_rms_adamw: 0.2 * sqrt(max(rows, cols))
    adamw_lr: float = 1e-3  # the AdamW part's
    adamw_betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    adamw_eps: float = 1e-8

    def check(self) -> None:
        OptimizerConfig.check(self)
        check(0 <= self.momentum < 1, "optimizer.momentum", self.momentum, "must be in [0, 1)")
        int_at_least("optimizer.ns_steps", self.ns_steps, 1)
        check(self.ns_steps < 100, "optimizer.ns_steps", self.ns_steps, "must be < 100 (torch.optim.Muon's limit)")
        finite_positive("optimizer.eps", self.eps)
        one_of("optimizer.adjust_lr_fn", self.adjust_lr_fn, ADJUST_LR)
        finite_positive("optimizer.adamw_lr", self.adamw_lr)
        check_betas(self.adamw_betas, "optimizer.adamw_betas")
        finite_positive("optimizer.adamw_eps", self.adamw_eps)


def is_hidden_matrix(name: str, param) -> bool:
    """Muon's share: 2-D weights that are neither the embedding nor the output matrix."""
    return param.ndim == 2 and "embed" not in name and "lm_head" not in name


def build(cfg: MuonConfig, named_params):
    from gradscale.optimizers._muon_hybrid import MuonHybrid

    matrices = [p for n, p in named_params if is_hidden_matrix(n, p)]
    others = [p for n, p in named_params if not is_hidden_matrix(n, p)]
    return MuonHybrid(
        matrices, others,
        muon=dict(lr=cfg.lr, weight_decay=cfg.weight_decay, momentum=cfg.momentum, nesterov=cfg.nesterov,
                  eps=cfg.eps, ns_steps=cfg.ns_steps, adjust_lr_fn=cfg.adjust_lr_fn),
        adamw=dict(lr=cfg.adamw_lr, betas=tuple(cfg.adamw_betas), eps=cfg.adamw_eps, weight_decay=cfg.weight_decay))


def refuse(cfg) -> tuple[str, str, str] | None:
    if cfg.dist.strategy == "fsdp2":
        return ("dist.strategy", cfg.dist.strategy, "optimizer=muon orthogonalises whole matrices, and FSDP2 hands "
                "each rank a shard (another optimizer): use dist.strategy=ddp")
    return None


ENTRY = OptimizerEntry(
    name="muon", label="Muon", config=MuonConfig, build=build, adam_state="part", refuse=refuse,
    # the twin is the AdamW part's (Muon's own clamp is far from binding); exact at powers of two
    scale_rule=ScaleRule("eps", eps_key="adamw_eps", twin=(("adamw_eps", -1),)),
    summary="Muon on hidden matrices (invariant), AdamW on embeddings, output, norms (eps-limited)",
)
