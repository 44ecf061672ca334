"""The audit: does a training loop hand its optimizer the gradient of the global token-mean loss?

A target is a step function, a built-in adapter around a framework's own training code or a zoo entry
(gradscale/audit/zoo.py), or the user's own `module:function`:

    def step(model, micro_batches, world) -> float | None

- model: the suite's tiny Llama 3.2 (a transformers LlamaForCausalLM, fp32), identical weights on every rank.
- micro_batches: this rank's K micro-batches, in order: dicts of `input_ids` and `labels`, [sequences, seq_len]
  each, transformers' convention (labels unshifted, -100 where no token is trained; the model predicts
  labels[t + 1] from position t, so trained tokens are those of labels[:, 1:] that are not -100).
- world: rank, size (N) and accumulation (K). torch.distributed is initialised already (gloo, CPU).
- The step runs forward and backward over the micro-batches, with its own reduction over ranks and its own
  scaling, and leaves in each parameter's .grad the gradient its optimizer would receive (before clipping).
  It returns the grad norm it would log, or None.

The audit runs the step on N real gloo ranks and K micro-batches of accumulation, on one fixed global batch that
is ragged on purpose (trained-token and trained-sequence counts differ across ranks and micro-batches), and compares
what each rank holds with the one-process float64 gradient of the objective the step declares (the global token
mean unless told; gradscale/audit/objectives.py), or with the step's own gradient at N = 1, K = 1 (reference
"layout"): the fitted multiplier c, the same per tensor group, the residual that no multiplier explains (fitted
against the known bad reductions where it fails), and the logged norm over the gradient's own.
"""

from gradscale.audit.batch import SEQ_LEN, batch_size_for, counts_of, global_batch, layout
from gradscale.audit.compare import TOLERANCE, Result, compare, meaning, reference_gradient
from gradscale.audit.contract import AuditError, World
from gradscale.audit.launch import ALLOWED_SIZES, REFERENCES, audit, audit_many, check_grid
from gradscale.audit.objectives import OBJECTIVES, SUSPECTS, objective
from gradscale.audit.output import as_json, assert_gradient_matches, format_table, report
from gradscale.audit.targets import builtin_targets, resolve_target

__all__ = ["ALLOWED_SIZES", "OBJECTIVES", "REFERENCES", "SEQ_LEN", "SUSPECTS", "TOLERANCE", "AuditError", "Result",
           "World", "as_json", "assert_gradient_matches", "audit", "audit_many", "batch_size_for", "builtin_targets",
           "check_grid", "compare", "counts_of", "format_table", "global_batch", "layout", "meaning", "objective",
           "reference_gradient", "report", "resolve_target"]
