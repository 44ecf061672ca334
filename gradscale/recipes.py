"""The normalization recipes: how summed token losses become the gradient the optimizer sees, as met in the
wild. One entry per recipe; the gradient pipeline (gradscale/grads.py), validation, the parity oracle
and the analysis read it. No torch here (validation and the analysis use it).

Every rank sums its sequences' token losses, each sequence weighted by `weights`, and calls backward; the
engine averages over the N ranks; then `factor` multiplies (T = the global trained-token count):

    recipe                      sequence weight         factor after the average   the optimizer sees
    global_tokens               1                       N / T                      g (correct)
    global_tokens_no_world_fix  1                       1 / T                      g / N (the bug)
    local_mean                  1 / T_r on rank r       1                          g only if all T_r are equal
    per_microbatch_mean         1 / (A * T_rk)          1                          g only if all T_rk are equal

g = the gradient of the global token-mean loss; A = grad_accum; T_r and T_rk: rank r's and its micro-batch k's
counts (a rank or micro-batch with none counts 1: it contributes a zero loss). With `scale` the optimizer
sees c_eff * g (c_eff below), for the recipes that divide by T.
"""

from __future__ import annotations

from dataclasses import dataclass

from gradscale.checks import one_of

MEAN_OVER = (None, "rank", "microbatch")


@dataclass(frozen=True)
class Recipe:
    """mean_over: None (every sequence has weight 1), "rank" or "microbatch": the token mean is taken there,
    before backward. divide_by_tokens: after the engine's average, divide by the global token count;
    times_world_size: and multiply by N, the world-size fix. without_fix: the recipe `fix=false` turns this
    one into (None: there is no fix to turn off)."""

    name: str
    mean_over: str | None
    divide_by_tokens: bool
    times_world_size: bool
    without_fix: str | None
    summary: str

    def __post_init__(self) -> None:
        if self.mean_over not in MEAN_OVER or self.mean_over is not None and self.divide_by_tokens:
            raise ValueError(f"recipe {self.name}: mean_over={self.mean_over!r} with divide_by_tokens="
                             f"{self.divide_by_tokens} (a token mean is taken once)")

    def factor(self, world_size: int, num_tokens: int) -> float:
        """What multiplies the ranks' averaged, weighted sums (scale and the average itself aside)."""
        if not self.divide_by_tokens:
            return 1.0  # the mean recipes normalized before backward
        return (world_size if self.times_world_size else 1.0) / max(num_tokens, 1)

    def c_eff(self, scale: float, world_size: int) -> float:
        """The optimizer sees c_eff times g: the studied factor c, and the missing world-size factor 1/N of
        the recipe without the fix. The mean recipes: c where every count is equal (their direction differs
        otherwise, which no multiplier describes)."""
        return scale / world_size if self.divide_by_tokens and not self.times_world_size else scale


RECIPES: dict[str, Recipe] = {r.name: r for r in (
    Recipe("global_tokens", None, divide_by_tokens=True, times_world_size=True,
           without_fix="global_tokens_no_world_fix",
           summary="token losses summed, / the global count, x N: correct"),
    Recipe("global_tokens_no_world_fix", None, divide_by_tokens=True, times_world_size=False, without_fix=None,
           summary="the same without x N (torchtune PR 2172): gradients 1/N too small"),
    Recipe("local_mean", "rank", divide_by_tokens=False, times_world_size=False, without_fix=None,
           summary="each rank's own token mean: correct only if all ranks' counts are equal"),
    Recipe("per_microbatch_mean", "microbatch", divide_by_tokens=False, times_world_size=False, without_fix=None,
           summary="each micro-batch's token mean: correct only if all their counts are equal"),
)}


def recipe(name: str, key: str = "normalization.name") -> Recipe:
    """The registry's recipe; an unknown name is a ConfigError naming the key and the known names."""
    one_of(key, name, RECIPES)
    return RECIPES[name]


def normalization_in_effect(fix: bool, normalization: str) -> str:
    """`fix` is the user's short switch for the common case: fix=false turns a recipe that has a fix
    (normalization=global_tokens) into its recipe without it. Every other recipe is taken as named."""
    without = recipe(normalization).without_fix
    return without if without and not fix else normalization


def c_eff(scale: float, normalization: str, world_size: int) -> float:
    """The effective multiplier of the recipe in effect (normalization_in_effect) at this scale and world size."""
    return recipe(normalization).c_eff(scale, world_size)


def with_fix(normalization: str) -> str:
    """The recipe a recipe without the fix comes from (itself for every other): pairs the bug with its fix."""
    return next((r.name for r in RECIPES.values() if r.without_fix == normalization), normalization)
