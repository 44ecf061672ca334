"""Built-in audit targets that run real framework code: each framework's own training step, not a copy.

    hf_trainer                     transformers.Trainer, average_tokens_across_devices on (its default)
    hf_trainer_no_token_average    the same with it off: each rank's own token count
    trl_sft                        TRL's SFTTrainer, fp32 (its config defaults to bf16)
    gradscale[_RECIPE]             this suite's own loop code (accumulate_gradients, GradPipeline.apply)

The trainers run one optimizer step (max_steps=1, gradient_accumulation_steps=K) on a data loader that yields
exactly this rank's micro-batches (the audit decides who sees what, so the trainer's sampler is replaced), with
an optimizer that keeps a copy of the gradients it is handed and changes nothing, and a clipping threshold that
never acts (so the trainer computes and logs its grad norm). The peers are an optional extra:
`pip install -e '.[peers]'`.
"""

from __future__ import annotations

import contextlib
import tempfile

import torch

from experiments.audit import World


class KeepGradients(torch.optim.Optimizer):
    """An optimizer whose step keeps a copy of each parameter's gradient and updates nothing."""

    def __init__(self, params):
        super().__init__(params, {"lr": 0.0})  # trainers read and log the lr
        self.kept: dict[torch.nn.Parameter, torch.Tensor] = {}

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    self.kept[p] = p.grad.detach().clone()


def _hf_training_arguments(args_class, world: World, out_dir: str, **extra):
    return args_class(output_dir=out_dir, per_device_train_batch_size=1, gradient_accumulation_steps=world.accumulation,
                      max_steps=1, max_grad_norm=1e30, logging_steps=1, report_to="none", save_strategy="no",
                      disable_tqdm=True, use_cpu=True, ddp_backend="gloo", dataloader_num_workers=0, seed=0,
                      lr_scheduler_type="constant", log_level="error", **extra)


def _run_trainer(trainer_class, model, micro_batches, args) -> float | None:
    """One optimizer step of an HF-style trainer on exactly these micro-batches; leaves the gradient its
    optimizer was handed in .grad and returns the grad norm it logged."""
    from accelerate.state import AcceleratorState, GradientState
    from torch.utils.data import DataLoader
    from transformers import TrainerCallback

    AcceleratorState._reset_state()  # the accelerate singletons keep the previous accumulation's settings
    GradientState._reset_state()
    logged: dict[str, float] = {}

    class KeepLogs(TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kwargs):
            logged.update(logs or {})

    class OnTheseBatches(trainer_class):
        def get_train_dataloader(self):  # the audit's micro-batches, in order, on this rank only
            return DataLoader(micro_batches, batch_size=None, shuffle=False)

    optimizer = KeepGradients(model.parameters())
    trainer = OnTheseBatches(model=model, args=args, train_dataset=_StandIn(micro_batches),
                             optimizers=(optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)),
                             callbacks=[KeepLogs()], **_processing_class(trainer_class))
    trainer.train()
    for p in model.parameters():
        p.grad = optimizer.kept.get(p)
    return logged.get("grad_norm")


class _StandIn(torch.utils.data.Dataset):
    """The train_dataset the trainers insist on (its length and columns); batches come from the loader."""

    def __init__(self, micro_batches):
        self.rows = [{"input_ids": ids, "labels": labels} for mb in micro_batches
                     for ids, labels in zip(mb["input_ids"], mb["labels"])]

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        return self.rows[i]


def _processing_class(trainer_class) -> dict:
    return {}


def hf_trainer(model, micro_batches, world: World) -> float | None:
    from transformers import Trainer, TrainingArguments

    with tempfile.TemporaryDirectory() as out:
        return _run_trainer(Trainer, model, micro_batches,
                            _hf_training_arguments(TrainingArguments, world, out, average_tokens_across_devices=True))


def hf_trainer_no_token_average(model, micro_batches, world: World) -> float | None:
    from transformers import Trainer, TrainingArguments

    with tempfile.TemporaryDirectory() as out:
        return _run_trainer(Trainer, model, micro_batches,
                            _hf_training_arguments(TrainingArguments, world, out, average_tokens_across_devices=False))


def gradscale_step(recipe_name: str):
    """This suite's own gradient code for one recipe: every rank is handed the global batch (gathered here)
    and takes its block, as the training loop does."""

    def step(model, micro_batches, world: World) -> float:
        import torch.distributed as dist

        from experiments import parallel, train
        from experiments.grads import GradPipeline

        # gradscale's targets are already shifted: targets[t] is the token predicted at position t
        local_inputs = torch.cat([mb["input_ids"][:, :-1] for mb in micro_batches])
        local_targets = torch.cat([mb["labels"][:, 1:] for mb in micro_batches])
        gathered = [[torch.empty_like(t) for _ in range(world.size)] for t in (local_inputs, local_targets)]
        dist.all_gather(gathered[0], local_inputs)
        dist.all_gather(gathered[1], local_targets)
        ranks = parallel.Ranks(world_size=world.size, rank=world.rank, real=True)
        net = parallel.wrap(model, ranks)
        pipeline = GradPipeline(world.size, 1.0, recipe_name, None, world.accumulation)
        _, num_tokens = train.accumulate_gradients(net, torch.cat(gathered[0]), torch.cat(gathered[1]), pipeline,
                                                   ranks, world.accumulation, contextlib.nullcontext(),
                                                   torch.device("cpu"))
        norm, _ = pipeline.apply(list(model.parameters()), num_tokens, ranks)
        return norm.item()

    step.__name__ = f"gradscale_{recipe_name}"
    return step


def _gradscale_targets() -> dict[str, tuple[str, str]]:
    from experiments.recipes import RECIPES

    return {("gradscale" if name == "global_tokens" else f"gradscale_{name}"):
            (f"experiments.audit.adapters:gradscale_{name}", f"gradscale's own loop, normalization={name}: {r.summary}")
            for name, r in RECIPES.items()}


def __getattr__(name: str):
    """gradscale_RECIPE for each recipe (module-level names, so that ranks can import them by name)."""
    from experiments.recipes import RECIPES

    if name.startswith("gradscale_") and name.removeprefix("gradscale_") in RECIPES:
        return gradscale_step(name.removeprefix("gradscale_"))
    raise AttributeError(name)


ADAPTERS: dict[str, tuple[str, str]] = {
    "hf_trainer": ("experiments.audit.adapters:hf_trainer",
                   "transformers.Trainer, average_tokens_across_devices=True (the default), "
                   "gradient_accumulation_steps=K"),
    "hf_trainer_no_token_average": ("experiments.audit.adapters:hf_trainer_no_token_average",
                                    "transformers.Trainer with average_tokens_across_devices=False"),
    **_gradscale_targets(),
}
