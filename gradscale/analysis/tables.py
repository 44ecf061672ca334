"""Tables from the loaded runs and curves: pairs with their reference, deviations, the theory's bands and
crossings, the equivalences. Tables in (gradscale.analysis.load), tables out; plots draw them, report writes them.

The reference of a run is the run identical but for scale 1 with the world-size fix on (c_eff = 1 in the
recipe HF Trainer and torchtune use).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pandas as pd

from gradscale.analysis.load import curve, read_jsonl
from gradscale.optimizers import entry as optimizer_entry
from gradscale.recipes import with_fix
from gradscale.records import GRAD_NORM, TRAIN_LOSS
from gradscale.runs import short_number
from gradscale.theory import breakdown_band, clipping_band, crossing, share_below, tensor_group, twin_value

# Columns that make two runs "the same experiment" apart from the studied factor.
PAIRING_KEYS = ("optimizer", "model", "finetune", "lr", "eps", "weight_decay", "world_size", "clip", "precision",
                "bf16_matmul", "normalization", "seed", "steps")


def is_reference(runs: pd.DataFrame) -> pd.Series:
    """Runs at scale 1 with the fix on and global_tokens in effect: the c_eff = 1 runs others pair with."""
    return (runs.scale == 1.0) & runs.fix & (runs.normalization == "global_tokens")


def pair_references(runs: pd.DataFrame) -> pd.Series:
    """For each run, the run identical in everything but scale and fix, at scale 1 with the fix on
    (None where the sweep has no such run). Indexed like `runs`, values are run names."""
    keys = list(PAIRING_KEYS)
    lookup = {_recipe(r, keys): r["run"] for _, r in runs[is_reference(runs)].iterrows()}
    found = [lookup.get(_recipe(r, keys)) for _, r in _recipe_up_to_c(runs).iterrows()]
    return pd.Series(found, index=runs.index, dtype=object)  # object: None stays None


def _recipe_up_to_c(runs: pd.DataFrame) -> pd.DataFrame:
    """A recipe without the fix differs from its recipe with it only by the factor c_eff already carries."""
    return runs.assign(normalization=runs.normalization.map(with_fix))


def _key(value):
    return "nan" if isinstance(value, float) and value != value else value  # NaN eps (SGD) pairs with itself


def _recipe(row, keys) -> tuple:
    """A run's settings under `keys`, as a lookup key."""
    return tuple(_key(row[k]) for k in keys)


def max_divergence(runs: pd.DataFrame, curves: pd.DataFrame) -> pd.Series:
    """Per run, max over steps of |loss - loss(reference)| (NaN without a reference, inf when it diverged)."""
    references = pair_references(runs)
    out = {}
    for i, r in zip(runs.index, runs.itertuples()):
        if references[i] is None or references[i] == r.run:
            out[r.run] = np.nan if references[i] is None else 0.0
            continue
        mine = curve(curves, r.run, TRAIN_LOSS)
        delta = (mine - curve(curves, references[i], TRAIN_LOSS)).abs()
        diverged = r.status == "diverged" or not np.isfinite(mine.to_numpy()).all()
        out[r.run] = np.inf if diverged else float(delta.max()) if len(delta.dropna()) else np.nan
    return pd.Series(out)


def one_percent_thresholds(runs: pd.DataFrame) -> dict[tuple[str, float], float]:
    """Per (setup, lr) with a reference: 1% of the reference's final loss, the threshold the breakdown is
    judged by."""
    references = pair_references(runs)
    final = runs.set_index("run").final_loss
    out = {}
    for i, r in zip(runs.index, runs.itertuples()):
        loss = final.get(references[i]) if references[i] is not None else None
        if loss is not None and not pd.isna(loss):
            out.setdefault((r.setup, r.lr), 0.01 * abs(float(loss)))
    return out


def equivalent_references(runs: pd.DataFrame) -> pd.DataFrame:
    """Pairs that the theory says train identically (docs/design.md physics 2-3), with c_eff != 1 on one side:
    each optimizer's twin rule (gradscale/optimizers/: SGD(lr, c) == SGD(lr*c, 1) without weight decay,
    AdamW(c, eps) == AdamW(1, eps/c)); where the run clips at M, its twin clips at M / c (c g clipped at M is c
    times g clipped at M / c: physics 13), up to the 1e-6 that torch adds to the norm. And physics 1, the bug is
    a pure rescale: a run at c_eff = 1 by another scale and fix (fix off at scale N) == its scale 1, fix-on
    reference. Columns: run, equivalent (the c_eff = 1 run), rule."""
    keys = [k for k in PAIRING_KEYS if k not in ("lr", "eps", "clip")]
    rows = []
    for reference, r in zip(pair_references(runs), runs.itertuples()):
        if np.isclose(r.c_eff, 1.0) and reference not in (None, r.run):
            rows.append({"run": r.run, "equivalent": reference,
                         "rule": f"scale={short_number(r.scale)}, fix {'on' if r.fix else 'off'} "
                                 f"(world_size {r.world_size}) == scale=1, fix on: the same c_eff = 1"})
    runs = _recipe_up_to_c(runs)
    unit = runs[np.isclose(runs.c_eff, 1.0)]
    for r in runs[~np.isclose(runs.c_eff, 1.0)].itertuples():
        optimizer = optimizer_entry(r.optimizer)
        rule = optimizer.scale_rule
        if not rule.twin or (rule.twin_needs_no_weight_decay and r.weight_decay != 0):
            continue
        clips = not pd.isna(r.clip)
        wanted = {"lr": r.lr, "eps": r.eps, "clip": r.clip / r.c_eff if clips else None}
        shown = []  # the twin's keys are lr or the rule's eps (a registry test says so)
        for key, power in rule.twin:
            column = "lr" if key == "lr" else "eps"
            wanted[column] = twin_value(getattr(r, column), r.c_eff, power)
            shown.append((key, getattr(r, column), wanted[column]))
        if clips:
            shown.append(("max_norm", r.clip, wanted["clip"]))
        match = np.logical_and.reduce([unit[column].map(lambda v, value=value: same_number(v, value)).to_numpy(bool)
                                       for column, value in wanted.items()])
        c = short_number(r.c_eff)
        if [key for key, _, _ in shown] == ["lr"]:
            _, lr, twin_lr = shown[0]
            label = optimizer.label
            text = f"{label}(lr={short_number(lr)}, c={c}) == {label}(lr={short_number(twin_lr)}, c=1)"
        else:
            mine = ", ".join(f"{key}={short_number(value)}" for key, value, _ in shown)
            theirs = ", ".join(f"{key}={short_number(value)}" for key, _, value in shown)
            text = f"{optimizer.label}(c={c}, {mine}) == {optimizer.label}(c=1, {theirs})"
        if clips:
            text += ", up to torch's 1e-6 in the clip"
        mine = {k: _key(getattr(r, k)) for k in keys}
        same = np.logical_and.reduce([[_key(v) == mine[k] for v in unit[k]] for k in keys])
        for equivalent in unit[match & same].run:
            rows.append({"run": r.run, "equivalent": equivalent, "rule": text})
    return pd.DataFrame(rows, columns=["run", "equivalent", "rule"])


def same_number(value, wanted) -> bool:
    """Equal to 1e-6 relative, None and NaN (no eps, no clipping) equal to each other."""
    if wanted is None or pd.isna(wanted):
        return value is None or pd.isna(value)
    return value is not None and not pd.isna(value) and math.isclose(value, wanted, rel_tol=1e-6)


def equivalence_table(runs: pd.DataFrame, curves: pd.DataFrame) -> pd.DataFrame:
    """equivalent_references with the measured max |Δ loss| of each pair over the logged steps."""
    table = equivalent_references(runs)
    deltas = []
    for r in table.itertuples():
        delta = (curve(curves, r.run, TRAIN_LOSS) - curve(curves, r.equivalent, TRAIN_LOSS)).abs()
        deltas.append(float(delta.max()) if len(delta.dropna()) else math.nan)
    return table.assign(**{"max abs Δloss": deltas})


def measured_bands(runs: pd.DataFrame, curves: pd.DataFrame) -> dict[str, tuple[float, float]]:
    """Per setup, the band of c_eff where the theory predicts the breakdown, from its reference run.

    Adam-type setups (eps): (eps/s_q10, eps/s_q90) from the reference's sqrt(v_hat) quantiles: at each
    recorded step the numel-weighted medians over tensors of each tensor's q10 and q90 give a band; the
    result spans them all (early in training s is smaller, so the breakdown starts at larger c).
    Clipped setups: theory.clipping_band of the reference's logged grad norms (the two bands are drawn
    apart: a clipped Adam setup gets the clipping band, which sits decades higher)."""
    bands = {}
    for r in runs[is_reference(runs)].itertuples():
        if r.setup in bands:
            continue
        if r.clip is not None and not pd.isna(r.clip):
            norms = curve(curves, r.run, GRAD_NORM).to_numpy()
            if len(norms):
                bands[r.setup] = clipping_band(norms, float(r.clip))
            continue
        stats = pd.DataFrame(read_jsonl(Path(r.path) / "adam_stats.jsonl")) if not pd.isna(r.eps) else pd.DataFrame()
        if stats.empty:
            continue
        medians = [{q: _weighted_median(g[q].to_numpy(), g.numel.to_numpy()) for q in ("q10", "q90")}
                   for _, g in stats.groupby("step")]
        # s = 0: most coordinates have had no gradient yet (LoRA's A at step 0); no finite c* to draw
        per_step = [breakdown_band(m, r.eps) for m in medians if min(m.values()) > 0]
        if per_step:
            bands[r.setup] = (max(b[0] for b in per_step), min(b[1] for b in per_step))
    return bands


def _weighted_median(values: np.ndarray, weights: np.ndarray) -> float:
    order = np.argsort(values)
    cumulative = np.cumsum(weights[order])
    return float(values[order][np.searchsorted(cumulative, cumulative[-1] / 2)])


GROUP_MULTIPLIERS = (1.0, 1 / 8, 1 / 64, 1 / 1024)  # c = 1, and the bug at world size 8, 64, 1024


def eps_share_table(runs: pd.DataFrame,
                    handed: Callable[[str, list[float], int], list[float] | None] | None = None) -> pd.DataFrame:
    """Per Adam-type reference run and tensor group, the share of coordinates with m s < eps at the run's
    last recorded step, for c = 1 and the world-size bug at N = 8, 64, 1024 (interpolated from each
    tensor's measured sqrt(v_hat) quantiles: theory.share_below; 1% and 99% are bounds). m is the multiplier
    sqrt(v_hat) carries at c: c itself, or where the run clips, the handed gradient's (physics 13), from
    handed(run path, the c's, step) (advise.handed_multipliers; None where the run logged no grad norm: then c,
    and the table says so); the table then gives m per N."""
    rows = []
    for r in runs[is_reference(runs) & ~runs.eps.isna()].drop_duplicates("setup").itertuples():
        stats = pd.DataFrame(read_jsonl(Path(r.path) / "adam_stats.jsonl"))
        if stats.empty:
            continue
        last = stats[stats.step == stats.step.max()]
        last = last.assign(group=last.tensor.map(tensor_group))
        step = int(last.step.iloc[0])
        clips = handed is not None and not pd.isna(r.clip)
        multipliers = handed(r.path, list(GROUP_MULTIPLIERS), step) if clips else None
        seen = dict(zip(GROUP_MULTIPLIERS, multipliers or GROUP_MULTIPLIERS))
        for group, tensors in last.groupby("group"):
            row = {"setup": r.setup, "model": r.model, "step": step, "group": group,
                   "coordinates": int(tensors.numel.sum())}
            for c in GROUP_MULTIPLIERS:
                shares = [share_below(t._asdict(), r.eps / seen[c]) for t in tensors.itertuples()]
                row[f"c={_short_c(c)}"] = float(np.average(shares, weights=tensors.numel))
            if clips:
                row["handed multiplier"] = ", ".join(
                    f"{_short_c(c)}: {short_number(seen[c], 2)}" for c in GROUP_MULTIPLIERS[1:]) if multipliers \
                    else "no grad norms logged: read at c"
            rows.append(row)
    return pd.DataFrame(rows)


def _short_c(c: float) -> str:
    return "1" if c == 1 else f"1/{round(1 / c)}"


def summary_table(runs: pd.DataFrame, curves: pd.DataFrame) -> pd.DataFrame:
    """Per run: setup, lr, scale, fix, c_eff, status, final loss, max |Δ loss| and the grad-norm ratio at
    step 0 against its reference, the share of steps clipped (where any run clips), its name (repeats at other
    seeds share every other column) and its reference's."""
    references = pair_references(runs)
    deltas = max_divergence(runs, curves)
    rows = []
    for i, r in zip(runs.index, runs.itertuples()):
        ratio = math.nan
        if references[i] is not None:
            mine, ref = curve(curves, r.run, GRAD_NORM), curve(curves, references[i], GRAD_NORM)
            if len(mine) and len(ref):
                ratio = float(mine.iloc[0] / ref.iloc[0])
        clipped = r.clipped_steps / r.steps_done if r.clip is not None and r.steps_done else math.nan
        rows.append({"setup": r.setup, "lr": r.lr, "scale": r.scale, "fix": r.fix, "c_eff": r.c_eff,
                     "status": r.status, "final loss": r.final_loss, "max abs Δloss vs ref": deltas[r.run],
                     "grad-norm ratio @ step 0": ratio, "clipped share": clipped, "run": r.run,
                     "reference": references[i]})
    table = pd.DataFrame(rows)
    return table.drop(columns="clipped share") if table["clipped share"].isna().all() else table


def theory_table(runs: pd.DataFrame, curves: pd.DataFrame) -> pd.DataFrame:
    """Per setup and lr with a reference: where the measured deviation passes 1% of the reference's final
    loss, below and above c = 1 (log-log interpolation on the grid), next to the predicted band."""
    deltas = max_divergence(runs, curves)
    bands = measured_bands(runs, curves)
    thresholds = one_percent_thresholds(runs)
    rows = []
    for (setup, lr), group in runs.assign(reference=pair_references(runs)).dropna(subset=["reference"]).groupby(
            ["setup", "lr"], sort=False):
        threshold = thresholds.get((setup, lr))
        if threshold is None or group.c_eff.nunique() < 2:
            continue
        c, d = group.c_eff.to_numpy(), group.run.map(deltas).to_numpy()
        band = bands.get(setup)
        rows.append({"setup": setup, "lr": lr, "1% of ref. loss": threshold,
                     "c_1% below 1": crossing_cell(c, d, threshold, "below"),
                     "c_1% above 1": crossing_cell(c, d, threshold, "above"),
                     "predicted band": "-" if band is None else
                     f"{short_number(min(band), 2)} .. {short_number(max(band), 2)}"})
    return pd.DataFrame(rows)


def crossing_cell(c_values, deviations, threshold: float, side: str) -> str:
    """theory.crossing for a table: a grid point as it is, an interpolated value marked as such with the two
    grid points it lies between, '-' when the deviation never passes the threshold on the grid."""
    value = crossing(c_values, deviations, threshold, side)
    if np.isnan(value):
        return "-"
    grid = np.unique(np.asarray(c_values, dtype=float))
    if np.isclose(grid, value, rtol=1e-9, atol=0).any():
        return f"{short_number(value)} (grid point)"
    low, high = grid[grid < value].max(), grid[grid > value].min()
    return f"≈{short_number(value)} (interpolated, {short_number(low)}..{short_number(high)})"


def seed_siblings(runs: pd.DataFrame) -> dict[str, list[str]]:
    """For each reference run (scale 1, fix on), the reference runs identical to it in everything but the seed,
    itself included: the repeats whose spread is what changing nothing but the data order does."""
    keys = [k for k in PAIRING_KEYS if k != "seed"]
    references = runs[is_reference(runs)]
    groups: dict[tuple, list[str]] = {}
    for _, r in references.iterrows():
        groups.setdefault(_recipe(r, keys), []).append(r["run"])
    return {run: group for group in groups.values() for run in group}


# run settings besides c_eff whose effect a study reads against the seed band
CONTRAST_KEYS = ("precision", "bf16_matmul")


def contrast_references(runs: pd.DataFrame, siblings: dict[str, list[str]]) -> dict[str, tuple[str, str]]:
    """For a reference run (scale 1, fix on) with no seed repeats of its own: the reference with seed repeats
    that is identical to it but in one of CONTRAST_KEYS (an fp32 control, or bf16 products by fp32 kernels,
    against the bf16 runs' band). What that setting does is then read against what the data order alone does,
    as the bug's c_eff is.
    {run: (that reference, the key they differ in)}. siblings: seed_siblings(runs)."""
    references = runs[is_reference(runs)]
    is_banded = references.run.map(lambda run: len(siblings[run]) >= 2).astype(bool)
    found = {}
    for key in CONTRAST_KEYS:  # the same in every other setting (seed too) and not a seed sibling: differs in key
        others = [k for k in PAIRING_KEYS if k != key]
        banded = {_recipe(r, others): r["run"] for _, r in references[is_banded].iterrows()}
        for _, r in references[~is_banded].iterrows():
            if _recipe(r, others) in banded:
                found.setdefault(r["run"], (banded[_recipe(r, others)], key))
    return found


def seed_curves(curves: pd.DataFrame, seeds: list[str], metric: str) -> pd.DataFrame:
    """metric of each seed repeat (a column per run), at the steps they all logged; its row-wise sample std
    (ddof 1) is what changing nothing but the data order does."""
    return pd.concat({s: curve(curves, s, metric) for s in seeds}, axis=1).dropna()


def compared_references(runs: pd.DataFrame) -> dict[str, tuple[str, str | None]]:
    """For each run that has one, the fixed run it is read against: its reference (pair_references); else
    the c_eff = 1 run the theory calls it equal to (equivalent_references: an eps / N repair of the bug); else,
    for a reference without seed repeats of its own, the banded run it differs from in one of CONTRAST_KEYS (that
    key comes second); else a banded stand-in (_stand_ins). {run: (reference, contrast key or None)}: what the
    seed band table and the token-frequency figures read each run against."""
    siblings = seed_siblings(runs)
    equivalents: dict[str, str] = {}
    for run, twin in equivalent_references(runs)[["run", "equivalent"]].itertuples(index=False):
        if run not in equivalents or len(siblings.get(twin, [])) > len(siblings.get(equivalents[run], [])):
            equivalents[run] = twin  # of several twins, the one with the most seed repeats (a banded reference)
    contrasts, stand_ins = contrast_references(runs, siblings), _stand_ins(runs, siblings)
    found = {}
    for r, paired in zip(runs.itertuples(), pair_references(runs)):
        if paired not in (None, r.run):
            found[r.run] = (paired, None)
        elif r.run in equivalents:
            found[r.run] = (equivalents[r.run], None)
        elif r.run in contrasts:
            found[r.run] = contrasts[r.run]
        elif r.run in stand_ins:
            found[r.run] = (stand_ins[r.run], None)
    return found


def _stand_ins(runs: pd.DataFrame, siblings: dict[str, list[str]]) -> dict[str, str]:
    """For a run at c_eff != 1 with neither a reference nor a twin: the one banded reference it stands against,
    identical to it but for scale and fix and either for eps, the run's being the twin rule's (a repair by eps
    alone, eps / N where the loop clips: the fixed run it means to reproduce), or for world_size (a reference's
    gradient is the global token mean however many ranks split the batch: physics 1; only the order of the sums
    differs). A run that differs in both, or matches several, has none. siblings: seed_siblings(runs)."""
    references = runs[is_reference(runs)]
    banded = references[references.run.map(lambda run: len(siblings[run]) >= 2).astype(bool)]
    found: dict[str, str] = {}
    for left_out in ("eps", "world_size"):
        # eps stays a key, compared at the value the twin rule gives the run's eps
        keys = PAIRING_KEYS if left_out == "eps" else [k for k in PAIRING_KEYS if k != left_out]
        candidates: dict[tuple, list[str]] = {}
        for _, r in banded.iterrows():
            candidates.setdefault(_recipe(r, keys), []).append(r["run"])
        for _, r in _recipe_up_to_c(runs).iterrows():
            if np.isclose(r["c_eff"], 1.0) or r["run"] in found:
                continue
            if left_out == "eps":  # the eps its twin would have: a repair by eps alone lands on the reference's
                eps_power = [power for key, power in optimizer_entry(r["optimizer"]).scale_rule.twin if key != "lr"]
                if not eps_power or pd.isna(r["eps"]):
                    continue
                r = r.copy()
                r["eps"] = twin_value(r["eps"], r["c_eff"], eps_power[0])
            mine = _recipe(r, keys)
            matches = [run for recipe, group in candidates.items() for run in group if _same_recipe(recipe, mine)]
            if len(matches) == 1:
                found[r["run"]] = matches[0]
    return found


def _same_recipe(a: tuple, b: tuple) -> bool:
    """Two recipes equal, their numbers to 1e-6 relative (a twin's eps is computed)."""
    return all(same_number(x, y) if isinstance(y, float) else x == y for x, y in zip(a, b))


def seed_band_table(runs: pd.DataFrame, curves: pd.DataFrame, metrics: list[str]) -> pd.DataFrame:
    """Every run against the run it is compared with (compared_references), read in units of the seed band: at
    the last step both logged `metric`, the difference run - reference, the sample standard deviation of the
    metric over the reference's seed siblings there (at least 2 seeds), and the difference in units of it; also
    the largest |difference| / std over all the steps they share. Rows only where the band exists."""
    siblings, compared = seed_siblings(runs), compared_references(runs)
    rows = []
    for r in runs.itertuples():
        reference, _ = compared.get(r.run, (None, None))
        if reference is None or len(siblings.get(reference, [])) < 2:
            continue
        for metric in metrics:
            seeds = seed_curves(curves, siblings[reference], metric)
            delta = (curve(curves, r.run, metric) - curve(curves, reference, metric)).dropna()
            steps = seeds.index.intersection(delta.index)
            if steps.empty:
                continue
            spread = seeds.loc[steps].std(axis=1, ddof=1)
            last = steps[-1]
            rows.append({"run": r.run, "reference": reference, "setup": r.setup, "c_eff": r.c_eff, "metric": metric,
                         "step": int(last), "difference": delta[last], "seed std": spread[last],
                         "seeds": seeds.shape[1], "difference / std": delta[last] / spread[last],
                         "max |difference| / std": (delta[steps].abs() / spread).max()})
    return pd.DataFrame(rows, columns=["run", "reference", "setup", "c_eff", "metric", "step", "difference",
                                       "seed std", "seeds", "difference / std", "max |difference| / std"])
