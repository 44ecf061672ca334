"""The model the audit hands the step: the suite's tiny Llama 3.2 unless the user names a factory of their own
(--model module:factory)."""

from __future__ import annotations

from collections.abc import Callable

from gradscale.audit.contract import AuditError, import_callable


def resolve_model(spec: str) -> Callable:
    """module:factory, as the callable (AuditError, one line, if it cannot be found). The factory takes no
    argument and returns a torch.nn.Module whose forward(input_ids=...) returns an output with .logits
    ([sequences, positions, vocabulary]) and whose config.vocab_size says how many token ids it takes."""
    module_name, _, name = spec.partition(":")
    if not module_name or not name:
        raise AuditError(f"error: --model {spec}: must be module:factory (a function that returns the model)")
    return import_callable(module_name, name, f"--model {spec}")


def vocab_size_of(model, spec: str | None) -> int:
    """The model's vocabulary, after checking that its gradient is a function of the batch alone (no dropout)."""
    import torch

    for name, module in model.named_modules():
        if isinstance(module, torch.nn.modules.dropout._DropoutNd) and module.p > 0:
            raise AuditError(f"error: --model {spec}: {name or 'the model'} drops out (p = {module.p:g}), so no two "
                             "runs of a step give the same gradient: return the model with its dropout at 0")
    vocab = getattr(getattr(model, "config", None), "vocab_size", None)
    if not isinstance(vocab, int) or vocab < 2:
        raise AuditError(f"error: --model {spec}: the model it returns has no config.vocab_size (an int), which the "
                         "audit draws its token ids below")
    return vocab
