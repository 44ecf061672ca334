"""What a run writes, named once: the metric keys of metrics.jsonl (the loop and the token buckets write them;
the plots, the report, the tables, the advisor and the W&B dashboard read them), and the layout of the
sqrt(v_hat) histograms in adam_stats.jsonl. No torch: the analysis imports it.
"""

from __future__ import annotations

# metrics.jsonl, every logged step
TRAIN_LOSS = "train/loss"  # token-mean loss of the step's batch
GRAD_NORM = "train/grad_norm"  # ||what the optimizer is given||, before clipping
CLIPPED = "train/clipped"  # whether clipping scaled the step's gradient
CLIP_COEF = "train/clip_coef"  # what clipping multiplied the gradient by (1: not clipped); only when clipping
TOKENS = "train/tokens"  # trained tokens of the step
LR = "train/lr"  # the first param group's lr (a hybrid's: its Muon part's)
PARAM_NORM = "train/param_norm"
UPDATE_RMS = "train/update_rms"  # RMS of the step's parameter change
TOKENS_PER_S = "perf/tokens_per_s"
# Adam's state, where the optimizer has it (OptimizerEntry.adam_state)
SQRT_V_RMS = "adam/sqrt_v_rms"
EPS_DOMINATED = "adam/eps_dominated_frac"  # share of coordinates with sqrt(v_hat) < eps
# eval steps
EVAL_LOSS = "eval/loss"  # held-out token-mean loss


# the token-frequency buckets of the held-out loss and the output-row updates (gradscale/frequency.py)
BUCKET_EDGES = (1, 10, 100)  # trained-target count in the training split: 0 | 1-9 | 10-99 | 100 or more
BUCKETS = ("unseen", "rare", "middle", "frequent")


def eval_loss_of(bucket: str) -> str:
    """Held-out loss of the targets in a token-frequency bucket (gradscale/frequency.py)."""
    return f"eval/loss_{bucket}"


def eval_tokens_of(bucket: str) -> str:
    return f"eval/tokens_{bucket}"


def output_update_rms_of(bucket: str) -> str:
    """Update RMS of the output matrix's rows of a bucket's tokens."""
    return f"train/output_update_rms_{bucket}"


# adam_stats.jsonl: per Adam-type tensor, a histogram over log10(sqrt(v_hat)), fixed bins of 1/8 decade from
# 1e-20 to 1e2 (values outside fall into the end bins), exact zeros apart (gradscale.analysis.advise reads it)
HIST_LOG10_MIN, HIST_LOG10_MAX, HIST_BINS_PER_DECADE = -20, 2, 8
HIST_BINS = (HIST_LOG10_MAX - HIST_LOG10_MIN) * HIST_BINS_PER_DECADE
