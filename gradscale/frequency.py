"""Where the world-size bug's cut lands: by how often a token is a target in the fine-tune's training split.

AdamW's update shrinks first on coordinates whose sqrt(v_hat) is below eps * N: the embedding / output rows
of tokens the fine-tune rarely trains on. Each token id falls in one bucket by its count of trained targets
in the training split (BUCKET_EDGES); at every eval the loop logs the held-out loss of each bucket's target
tokens (eval/loss_<bucket>, eval/tokens_<bucket>) and the RMS of that step's update of each bucket's rows of
the output matrix (tied to the input embedding in Llama 3.2 and SmolLM2): train/output_update_rms_<bucket>.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from gradscale.data import IGNORE_INDEX
from gradscale.records import BUCKET_EDGES, BUCKETS, eval_loss_of, eval_tokens_of, output_update_rms_of


@dataclass
class TokenBuckets:
    of_token: torch.Tensor  # [vocab] bucket index of each token id
    output_weight: torch.Tensor | None  # the output matrix [vocab, hidden]; None: its rows are not measured

    @classmethod
    def of(cls, train_targets: torch.Tensor, vocab_size: int, output_weight: torch.Tensor | None,
           device: torch.device) -> TokenBuckets:
        trained = train_targets[train_targets != IGNORE_INDEX]
        counts = torch.bincount(trained.flatten(), minlength=vocab_size)[:vocab_size]
        return cls(torch.bucketize(counts, torch.tensor(BUCKET_EDGES), right=True).to(device), output_weight)

    def loss_record(self, loss_sums: torch.Tensor, token_counts: torch.Tensor) -> dict[str, float]:
        """eval/loss_<bucket> (token mean) and eval/tokens_<bucket>, from per-bucket sums (bucket_sums)."""
        record = {}
        for i, name in enumerate(BUCKETS):
            tokens = int(token_counts[i])
            record[eval_tokens_of(name)] = tokens
            if tokens:
                record[eval_loss_of(name)] = float(loss_sums[i]) / tokens
        return record

    def bucket_sums(self, token_losses: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Per bucket: the summed token losses and the number of trained targets."""
        trained = targets != IGNORE_INDEX
        bucket = self.of_token[targets[trained]]
        sums = torch.zeros(len(BUCKETS), device=targets.device).index_add_(0, bucket, token_losses[trained].float())
        return sums, torch.bincount(bucket, minlength=len(BUCKETS))

    def rows_before_step(self) -> torch.Tensor | None:
        return None if self.output_weight is None else self.output_weight.detach().clone()

    def row_update_record(self, before: torch.Tensor) -> dict[str, float]:
        """train/output_update_rms_<bucket>: RMS over the bucket's rows' coordinates of this step's update.
        In place in `before`: the copy is the only extra output matrix an eval step holds."""
        squares = before.sub_(self.output_weight.detach()).square_().sum(1)
        record = {}
        for i, name in enumerate(BUCKETS):
            in_bucket = self.of_token == i
            if in_bucket.any():
                record[output_update_rms_of(name)] = float(
                    (squares[in_bucket].sum() / (in_bucket.sum() * before.shape[1])).sqrt())
        return record
