"""Built-in audit targets that run real framework code: each framework's own training step, not a copy.

    hf_trainer                     transformers.Trainer, average_tokens_across_devices on (its default)
    hf_trainer_no_token_average    the same with it off: each rank's own token count
    accelerate_docs_loop           Accelerate's accumulate() loop as its guide shows first (mean loss per micro-batch)
    accelerate_token_loop          Accelerate's loop for samples of variable size (the gathered token count)
    lightning_docs_loop            Lightning's Trainer as its docs show accumulation (mean loss per micro-batch)
    lightning_token_loop           Lightning's Trainer with the loss over the global trained-token count
    trl_sft                        TRL's SFTTrainer, fp32 (its config defaults to bf16)
    trl_grpo_LOSS                  TRL's GRPOTrainer for each loss type; trl_grpo_1_9_0_LOSS: the release before PR 6024
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
from dataclasses import dataclass
from pathlib import Path

import torch

from gradscale.audit.contract import AuditError, World


class KeepGradients(torch.optim.Optimizer):
    """An optimizer whose step keeps a copy of each parameter's gradient and updates nothing."""

    def __init__(self, params):
        super().__init__(params, {"lr": 0.0})  # trainers read and log the lr
        self.kept: dict[torch.nn.Parameter, torch.Tensor] = {}

    @torch.no_grad()
    def step(self, closure=None):
        if closure is not None:  # Lightning's automatic optimization runs forward and backward in it
            with torch.enable_grad():
                closure()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    self.kept[p] = p.grad.detach().clone()


def _hf_training_arguments(args_class, world: World, out_dir: str, **extra):
    """The trainers' arguments for one step of K micro-batches; extra adds to them or overrides them."""
    return args_class(**{"output_dir": out_dir, "per_device_train_batch_size": 1,
                         "gradient_accumulation_steps": world.accumulation, "max_steps": 1, "max_grad_norm": 1e30,
                         "logging_steps": 1, "report_to": "none", "save_strategy": "no", "disable_tqdm": True,
                         "use_cpu": True, "ddp_backend": "gloo", "dataloader_num_workers": 0, "seed": 0,
                         "lr_scheduler_type": "constant", "log_level": "error", **extra})


def _run_trainer(trainer_class, model, micro_batches, args, train_dataset=None, **trainer_kwargs) -> float | None:
    """One optimizer step of an HF-style trainer on exactly these micro-batches (what its loader yields, in order:
    GRPO's are generation batches); leaves the gradient its optimizer was handed in .grad and returns the grad norm
    it logged. train_dataset: the one it insists on (default _stand_in's); trainer_kwargs go to the trainer."""
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
    trainer = OnTheseBatches(model=model, args=args,
                             train_dataset=_stand_in(micro_batches) if train_dataset is None else train_dataset,
                             optimizers=(optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)),
                             callbacks=[KeepLogs()], **_processing_class(trainer_class, model), **trainer_kwargs)
    trainer.train()
    for p in model.parameters():
        p.grad = optimizer.kept.get(p)
    return logged.get("grad_norm")


def _stand_in(micro_batches):
    """The train_dataset the trainers insist on (a datasets.Dataset, for its length and columns); the batches
    come from the loader."""
    from datasets import Dataset

    return Dataset.from_dict({key: [row.tolist() for mb in micro_batches for row in mb[key]]
                              for key in micro_batches[0]})


def _processing_class(trainer_class, model) -> dict:
    """TRL's trainers insist on a tokenizer (for padding); the batches are tokenized already."""
    if trainer_class.__module__.startswith("transformers"):
        return {}
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(model.config.vocab_size)}  # a word per id: any id the batch holds
    return {"processing_class": PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab, "t0")),
                                                        pad_token="t0", eos_token="t1")}



def find_peer(module: str, folder: Path | None = None, install: str | None = None) -> bool:
    """Whether a peer framework must come from a peers folder rather than the environment; an AuditError saying
    how to install it when it is in neither. folder None: .peers/ (`make peers`, which keeps it off the path of
    everything else), where the environment's copy, if any, comes first; a folder of its own (a release pinned
    beside the current one, `make peers` too): only that folder, as the environment's copy is another version.
    Imports nothing and leaves sys.path as it is: a process that then loads a model keeps torchao out."""
    import importlib.util

    top = module.split(".")[0]
    if folder is None and importlib.util.find_spec(top) is not None:
        return False
    if ((folder or PEERS_DIR) / top).is_dir():
        return True
    if folder is not None:
        raise AuditError(f"error: {top} is not installed in {folder.name}/: make peers (in a clone)")
    install = install or "pip install 'gradscale[peers]' (in a clone: make peers)"
    raise AuditError(f"error: {top} is not installed: {install}")


def peer(module: str, folder: Path | None = None):
    """The peer framework's module, imported (in a rank process, after its model is loaded), from folder where
    given (find_peer). A process imports a framework once: one that already holds the framework from another
    folder (a launch mixing the targets of two releases) is refused in one line."""
    import importlib
    import sys

    top = module.split(".")[0]
    if top in sys.modules and _pinned_folder(sys.modules[top]) != folder:
        found = Path(getattr(sys.modules[top], "__file__", None) or top).parent
        raise AuditError(f"error: this process imported {top} from {found} already: audit the targets of each "
                         f"{top} release in a launch of their own")
    if find_peer(module, folder):
        where = str(folder or PEERS_DIR)
        if where not in sys.path:
            # .peers/ after the environment (find_peer preferred its copy); a pinned release before it
            sys.path.insert(len(sys.path) if folder is None else 0, where)
            importlib.invalidate_caches()
    return importlib.import_module(module)


def _pinned_folder(module) -> Path | None:
    """The pinned-release folder (.peers-NAME-VERSION/) a module was imported from, None for any other place."""
    here = Path(getattr(module, "__file__", None) or ".").resolve()
    return next((p for p in here.parents if p.parent == PEERS_DIR.parent and p.name.startswith(".peers-")), None)


PEERS_DIR = Path(__file__).resolve().parents[2] / ".peers"  # a clone's `make peers`; an installed package has none
# TRL's last release before PR 6024: 1.9.1 is the first with the fix, and its grpo_trainer.py differs from 1.9.0's by
# that fix alone. In a folder of its own, which `make peers` fills (the Makefile reads the folder's name here).
TRL_BEFORE_PR_6024 = PEERS_DIR.parent / ".peers-trl-1.9.0"


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


class _LogitsOnly(torch.nn.Module):
    """The suite's model as torchtune's recipe calls it: model(**batch) -> logits, chunked for its loss."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, input_ids):
        return [self.model(input_ids=input_ids).logits]  # one chunk: CEWithChunkedOutputLoss(num_output_chunks=1)


def torchtune(model, micro_batches, world: World) -> float | None:
    """torchtune 0.6.1's full fine-tune distributed recipe: its own train() loop (loss times the micro-batch's
    token count, all-reduced token count, scale_grads(world_size / num_tokens), clip_grad_norm_) on FSDP2 over
    gloo. Built without its setup(), which would load torchtune's checkpoint, tokenizer and dataset: the model,
    loss, optimizer and loader are set as setup() sets them, the model and batches the audit's."""
    return _torchtune_recipe(model, micro_batches, world)


def torchtune_pr2172(model, micro_batches, world: World) -> float | None:
    """The zoo mutation of torchtune's step before PR 2172: scale_grads(1 / num_tokens), without the world size
    that undoes FSDP2's average over ranks."""
    training = peer("torchtune.training")
    real = training.scale_grads
    training.scale_grads = lambda net, factor: real(net, factor / world.size)  # the pre-fix factor
    try:
        return _torchtune_recipe(model, micro_batches, world)
    finally:
        training.scale_grads = real


def _torchtune_recipe(model, micro_batches, world: World) -> float | None:
    import warnings

    from torch.distributed.device_mesh import init_device_mesh

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        training = peer("torchtune.training")
        from torchtune.modules.loss import CEWithChunkedOutputLoss

    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    net = _LogitsOnly(model)
    training.shard_model(net, [lambda name, m: isinstance(m, LlamaDecoderLayer)], cpu_offload=False,
                         dp_mesh=init_device_mesh("cpu", (world.size,)))
    logged: dict = {}

    class KeepLogs:
        def log_dict(self, payload, step):
            logged.update(payload)

    class Loader(list):
        sampler = type("Sampler", (), {"set_epoch": lambda self, epoch: None})()

        def state_dict(self):
            return {}

    recipe_class = _torchtune_recipe_module().FullFinetuneRecipeDistributed
    recipe = recipe_class.__new__(recipe_class)
    optimizer = KeepGradients(net.parameters())
    loss = CEWithChunkedOutputLoss(num_output_chunks=1)
    recipe.__dict__.update(
        _model=net, _optimizer=optimizer, _optimizer_in_bwd=False, _loss_fn=loss, _lr_scheduler=None,
        _dataloader=Loader(dict(mb) for mb in micro_batches), _gradient_accumulation_steps=world.accumulation,
        _clip_grad_norm="inf",  # its documented way to log the norm without clipping
        _device=torch.device("cpu"), _is_rank_zero=world.rank == 0, _log_every_n_steps=1,
        _log_peak_memory_stats=False, _metric_logger=KeepLogs(), _steps_per_epoch=1, max_steps_per_epoch=1,
        total_epochs=1, epochs_run=0, global_step=0, seed=0, world_size=world.size,
        ignore_labels_cache=torch.full((64, 1), loss.ignore_index), activations_handling_ctx=contextlib.nullcontext(),
        _profiler=training.DummyProfiler(), profiler_profile_memory=False, profiler_wait_steps=0,
        profiler_warmup_steps=0, profiler_active_steps=0,
        _checkpoint_client=type("NoCheckpoint", (), {"save_checkpoint": lambda self, **kwargs: None})())
    cleanup = training.cleanup_before_training
    training.cleanup_before_training = lambda: None  # it calls torch.cpu.empty_cache, which torch does not have
    try:
        recipe.train()
    finally:
        training.cleanup_before_training = cleanup
    for p in net.parameters():
        p.grad = optimizer.kept.get(p)
    norm = logged.get("grad_norm")
    return None if norm is None else float(norm)


def _torchtune_recipe_module():
    """recipes/full_finetune_distributed.py as torchtune installs it (its recipes/__init__.py refuses imports,
    so the file is loaded by path, once)."""
    import importlib.util
    import sys
    import warnings

    name = "torchtune_full_finetune_distributed"
    if name not in sys.modules:
        folder = importlib.util.find_spec("recipes").submodule_search_locations[0]  # does not run __init__
        spec = importlib.util.spec_from_file_location(name, f"{folder}/full_finetune_distributed.py")
        module = importlib.util.module_from_spec(spec)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            spec.loader.exec_module(module)
        sys.modules[name] = module
    return sys.modules[name]


def trl_sft(model, micro_batches, world: World) -> float | None:
    """TRL's SFTTrainer in fp32 (SFTConfig defaults to bf16), on batches tokenized already."""
    peer("trl")
    from trl import SFTConfig, SFTTrainer

    with_mask = [{**mb, "attention_mask": torch.ones_like(mb["input_ids"])} for mb in micro_batches]  # TRL counts it
    with tempfile.TemporaryDirectory() as out:
        args = _hf_training_arguments(SFTConfig, world, out, bf16=False, dataset_kwargs={"skip_prepare_dataset": True})
        return _run_trainer(SFTTrainer, model, with_mask, args)


def grpo_steps_per_generation(k: int) -> int:
    """steps_per_generation S for accumulation K. K = 1: S = 1, so that --reference layout's N = 1, K = 1 row is
    the plain step; K = 2: S = 1, two generations in one optimizer step (S < K); K > 2: S = 2K, a generation spans
    two optimizer steps (S > K, as in PR 6024's example S = 4, K = 2). Before PR 6024 dapo, cispo and vespo were
    x K / S."""
    return 1 if k <= 2 else 2 * k
GRPO_LOSS_TYPES = {  # TRL's loss types, each with how its _compute_loss normalizes a micro-batch
    "dapo": "over num_items_in_batch, the generation batch's token count (TRL's default)",
    "cispo": "as dapo, its clipped ratios as coefficients",
    "vespo": "as dapo, with its gamma weights",
    "grpo": "each sequence's token mean, meaned over the micro-batch, / K",
    "sapo": "as grpo, with its soft gate",
    "bnpo": "over the micro-batch's own token count, / K",
    "dr_grpo": "over sequences x max_completion_length, / K",
    "luspo": "each sequence's token sum, meaned over the micro-batch, / K",
}


def _trl_grpo(model, micro_batches, world: World, loss_type: str, folder: Path | None) -> float | None:
    """TRL's GRPOTrainer.train(), one optimizer step, through its own _prepare_inputs (a generation every S steps,
    buffered and split into S chunks), _generate_and_score_completions (its num_items_in_batch: the generation
    batch's loss-mask tokens gathered over the ranks), _compute_loss for loss_type and the Trainer's accumulation.

    What the adapter sets, and why:
    - No generation: TRL's rollout_func hook returns the audit's sequences as completions. A sequence's first
      token is the prompt, the other 23 its completion, and its env_mask (TRL's mask for completion tokens the
      model did not generate, such as tool output) is labels[1:] != -100: TRL's loss mask is then the audit's
      trained positions and its logits those of model(input_ids), with no padding at all.
    - The generation batch holds exactly the step's micro-batches, unshuffled: where S >= K it is the K
      micro-batches in order, repeated to fill S chunks (the step takes the first K; the rest are the next
      step's share, which counts in num_items_in_batch as TRL counts it); where S < K each generation is the next
      S micro-batches. TRL shuffles a generation batch before splitting it (shuffle_sequence_dict), which would
      deal the step a random share of it: that shuffle is the identity for the step.
    - Advantages 1 for every completion, set on the output of TRL's _generate_and_score_completions. TRL's own
      are rewards normalized within groups of num_generations consecutive completions of the gathered batch,
      and which sequences share a group depends on the layout (the audit replaces TRL's sampler, which keeps a
      prompt's generations together). With advantage 1 and old log-probabilities equal to the current ones
      (num_iterations=1: TRL takes per_token_logps.detach(), or where S > K computes them in a forward of the
      same weights on the same chunks), the ratio is 1 and the surrogate's gradient is the cross-entropy's,
      weighted as the loss type weighs its tokens: dapo is the token mean, grpo a mean of sequence means.
      The rewards (0) only feed TRL's advantages, which this replaces; num_generations 2, the least TRL allows.
    - beta 0 (no reference model), fp32, no gradient checkpointing (GRPOConfig defaults to bf16 and to it).
    """
    peer("trl", folder)
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer
    from trl.trainer import grpo_trainer

    k, s = world.accumulation, grpo_steps_per_generation(world.accumulation)
    rows = len(micro_batches[0]["input_ids"])
    sequences = {f"{j},{i}": (mb["input_ids"][i], mb["labels"][i]) for j, mb in enumerate(micro_batches)
                 for i in range(rows)}

    def generation_batch(step: int) -> list[dict]:  # the rows of the generation TRL draws at this step
        first = step // s * s
        return [{"prompt": f"{(first + c) % k},{i}"} for c in range(s) for i in range(rows)]

    def rollout(prompts, trainer) -> dict:
        ids, labels = zip(*(sequences[p] for p in prompts))
        return {"prompt_ids": [x[:1].tolist() for x in ids], "completion_ids": [x[1:].tolist() for x in ids],
                "logprobs": None, "env_mask": [(y[1:] != -100).int().tolist() for y in labels]}

    def no_reward(completions, **kwargs):
        return [0.0] * len(completions)

    class FixedAdvantages(GRPOTrainer):
        def _generate_and_score_completions(self, inputs):
            output = super()._generate_and_score_completions(inputs)
            output["advantages"] = torch.ones_like(output["advantages"])
            return output

    shuffle = grpo_trainer.shuffle_sequence_dict
    grpo_trainer.shuffle_sequence_dict = lambda batch: batch
    try:
        with tempfile.TemporaryDirectory() as out:
            args = _hf_training_arguments(
                GRPOConfig, world, out, per_device_train_batch_size=rows, steps_per_generation=s, num_generations=2,
                loss_type=loss_type, beta=0.0, num_iterations=1, bf16=False, gradient_checkpointing=False,
                importance_sampling_level="sequence" if loss_type == "luspo" else "token")
            return _run_trainer(FixedAdvantages, model, [generation_batch(step) for step in range(k)], args,
                                train_dataset=Dataset.from_dict({"prompt": list(sequences)}),
                                reward_funcs=no_reward, rollout_func=rollout)
    finally:
        grpo_trainer.shuffle_sequence_dict = shuffle


def accelerate_docs_loop(model, micro_batches, world: World) -> float | None:
    """Accelerate's gradient-accumulation loop as its guide shows it first: the model's own loss (each
    micro-batch's token mean), accelerator.backward (which divides by K) inside accelerator.accumulate, DDP."""
    accelerator, net, prepared, optimizer = _accelerator(model, world)
    norm = None
    for mb in micro_batches:
        with accelerator.accumulate(net):
            accelerator.backward(net(**mb).loss)
            if accelerator.sync_gradients:
                norm = torch.nn.utils.get_total_norm([p.grad for p in net.parameters() if p.grad is not None]).item()
            prepared.step()
            prepared.zero_grad()
    return _kept(model, optimizer, norm)


def accelerate_token_loop(model, micro_batches, world: World) -> float | None:
    """Accelerate's loop for samples of variable size (examples/by_feature/
    gradient_accumulation_for_autoregressive_models.py): the count of labels.ne(-100) gathered from every process,
    the model's loss over it (num_items_in_batch) x K x processes, accelerator.backward, no_sync but for the
    last micro-batch. The count is taken as the example takes it, on the labels the model is handed."""
    from contextlib import nullcontext

    accelerator, net, prepared, optimizer = _accelerator(model, world)
    local = sum(mb["labels"].ne(-100).sum() for mb in micro_batches)
    items = accelerator.gather(local).sum().item()
    for i, mb in enumerate(micro_batches):
        last = i == len(micro_batches) - 1
        with net.no_sync() if not last and accelerator.num_processes > 1 else nullcontext():
            loss = net(**mb, use_cache=False, num_items_in_batch=items).loss
            accelerator.backward(loss * world.accumulation * accelerator.num_processes)
    norm = torch.nn.utils.get_total_norm([p.grad for p in net.parameters() if p.grad is not None]).item()
    prepared.step()
    return _kept(model, optimizer, norm)


def lightning_docs_loop(model, micro_batches, world: World) -> float | None:
    """Lightning's Trainer as its docs show accumulation first: training_step returns the model's own loss (each
    micro-batch's token mean), Trainer(accumulate_grad_batches=K) divides it by K, DDPStrategy on gloo averages
    over ranks."""
    return _lightning_fit(model, micro_batches, world, lambda net, batch: net(**batch).loss)


def lightning_token_loop(model, micro_batches, world: World) -> float | None:
    """Lightning's Trainer with the loss over the step's global trained-token count (labels shifted as the model
    shifts them, all-reduced over ranks), times K and N to undo Lightning's division by K and DDP's average.
    Lightning's docs describe no token-count loop; this is the one its automatic optimization needs."""
    import torch.distributed as dist

    from gradscale.audit.contract import trained_tokens

    items = torch.tensor(float(sum(trained_tokens(mb["labels"]) for mb in micro_batches)))
    dist.all_reduce(items)
    return _lightning_fit(model, micro_batches, world, lambda net, batch: net(
        **batch, num_items_in_batch=items).loss * world.accumulation * world.size)


def _lightning_fit(model, micro_batches, world: World, loss_of) -> float | None:
    """One optimizer step of Lightning's own Trainer (automatic optimization: its accumulation, its no_sync, its
    DDP over the audit's process group, which Lightning finds initialized and keeps) on exactly these micro-batches,
    with KeepGradients as the optimizer. Lightning logs no grad norm: None."""
    import logging
    import warnings

    peer("lightning")
    import lightning.pytorch as pl
    from lightning.pytorch.strategies import DDPStrategy
    from torch.utils.data import DataLoader

    for name in ("lightning.pytorch", "lightning.fabric"):  # its notes on the environment, per rank
        logging.getLogger(name).setLevel(logging.ERROR)
    optimizer_of: list[KeepGradients] = []

    class Module(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = model

        def training_step(self, batch, batch_idx):
            return loss_of(self.net, batch)

        def configure_optimizers(self):
            optimizer_of.append(KeepGradients(self.net.parameters()))
            return optimizer_of[0]

    with tempfile.TemporaryDirectory() as out, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = pl.Trainer(accelerator="cpu", devices=world.size, num_nodes=1,
                             strategy=DDPStrategy(process_group_backend="gloo"),
                             accumulate_grad_batches=world.accumulation, max_steps=1, use_distributed_sampler=False,
                             logger=False, enable_checkpointing=False, enable_progress_bar=False,
                             enable_model_summary=False, default_root_dir=out)
        trainer.fit(Module(), DataLoader(micro_batches, batch_size=None, shuffle=False))
    return _kept(model, optimizer_of[0], None)


def deepspeed_docs_loop(model, micro_batches, world: World) -> float | None:
    """DeepSpeed's loop as its getting-started guide shows it: the model's own loss (each micro-batch's token
    mean), engine.backward (which divides by gradient_accumulation_steps = K), engine.step; ZeRO stage 2 on gloo."""
    return _deepspeed_step(model, micro_batches, world, lambda net, mb, items: net(**mb).loss)


def deepspeed_token_loop(model, micro_batches, world: World) -> float | None:
    """That loop with the loss over the global trained-token count (labels[:, 1:], summed over ranks), x K x N:
    the engine divides by K and averages over the ranks."""
    return _deepspeed_step(model, micro_batches, world, lambda net, mb, items: (
        net(**mb, num_items_in_batch=items).loss * world.accumulation * world.size))


def _deepspeed_step(model, micro_batches, world: World, loss_of) -> float | None:
    """One step of K micro-batches through a DeepSpeed engine (ZeRO stage 2, fp32, on the CPU: DS_ACCELERATOR=cpu)
    around torch SGD at lr 0; the gradient is read at the accumulation boundary, before engine.step, as the whole
    averaged gradient on every rank (deepspeed.utils.safe_get_full_grad: ZeRO 2 keeps only a shard per rank)."""
    import os

    import torch.distributed as dist

    from gradscale.audit.contract import trained_tokens

    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    deepspeed = peer("deepspeed")
    from deepspeed.utils import safe_get_full_grad

    deepspeed.init_distributed(dist_backend="gloo")  # the audit's process group, kept
    items = torch.tensor(sum(trained_tokens(mb["labels"]) for mb in micro_batches))
    dist.all_reduce(items)
    micro = len(micro_batches[0]["input_ids"])
    config = {"train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": world.accumulation,
              "train_batch_size": micro * world.accumulation * world.size, "zero_optimization": {"stage": 2},
              "zero_allow_untested_optimizer": True, "steps_per_print": 10**9}
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.0),
                                      config=config)
    grads = {}
    for mb in micro_batches:
        engine.backward(loss_of(engine, mb, items.item()))
        if engine.is_gradient_accumulation_boundary():
            grads = {p: safe_get_full_grad(p) for p in model.parameters()}  # a collective: every rank calls it
        engine.step()
    for p in model.parameters():
        p.grad = grads[p].detach().clone()
    return None


def _accelerator(model, world: World):
    """A fresh Accelerator (its singletons reset: one job per accumulation runs in this process) with K as its
    gradient_accumulation_steps, and the model and a KeepGradients optimizer prepared."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    accelerator = Accelerator(gradient_accumulation_steps=world.accumulation, cpu=True)
    optimizer = KeepGradients(model.parameters())
    net, prepared = accelerator.prepare(model, optimizer)
    return accelerator, net, prepared, optimizer


def _kept(model, optimizer: KeepGradients, norm: float | None) -> float | None:
    for p in model.parameters():
        p.grad = optimizer.kept.get(p)
    return norm


def gradscale_step(recipe_name: str):
    """This suite's own gradient code for one recipe: every rank is handed the global batch (gathered here)
    and takes its block, as the training loop does."""

    def step(model, micro_batches, world: World) -> float:
        import torch.distributed as dist

        from gradscale import parallel, train
        from gradscale.grads import GradPipeline

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


def _grpo_step(loss_type: str, folder: Path | None):
    def step(model, micro_batches, world: World) -> float | None:
        return _trl_grpo(model, micro_batches, world, loss_type, folder)

    return step


def _grpo_targets() -> dict[str, tuple[str, Path | None]]:
    """trl_grpo_LOSS (the peers' TRL) and trl_grpo_1_9_0_LOSS (the release before PR 6024) for each loss type."""
    releases = {"trl_grpo": None, "trl_grpo_1_9_0": TRL_BEFORE_PR_6024}
    return {f"{prefix}_{loss}": (loss, folder) for prefix, folder in releases.items() for loss in GRPO_LOSS_TYPES}


def _gradscale_targets() -> dict[str, tuple[str, str]]:
    from gradscale.recipes import RECIPES

    return {("gradscale" if name == "global_tokens" else f"gradscale_{name}"):
            (f"gradscale.audit.adapters:gradscale_{name}", f"gradscale's own loop, normalization={name}: {r.summary}")
            for name, r in RECIPES.items()}


def __getattr__(name: str):
    """gradscale_RECIPE for each recipe (module-level names, so that ranks can import them by name)."""
    from gradscale.recipes import RECIPES

    if name.startswith("gradscale_") and name.removeprefix("gradscale_") in RECIPES:
        return gradscale_step(name.removeprefix("gradscale_"))
    if name in _grpo_targets():
        return _grpo_step(*_grpo_targets()[name])
    raise AttributeError(name)


@dataclass(frozen=True)
class Adapter:
    """A built-in target around a framework's own step: where it is, a line for the target list, and the peer
    framework it needs from .peers/ or the environment (None: transformers and torch only)."""

    target: str  # module:function
    summary: str
    requires: str | None = None
    peers: Path | None = None  # a folder of its own for a pinned release (find_peer); None: .peers/
    install: str | None = None  # how to install `requires` where `make peers` does not (None: it does)


ADAPTERS: dict[str, Adapter] = {
    "hf_trainer": Adapter("gradscale.audit.adapters:hf_trainer",
                          "transformers.Trainer, average_tokens_across_devices=True (the default), "
                          "gradient_accumulation_steps=K"),
    "hf_trainer_no_token_average": Adapter("gradscale.audit.adapters:hf_trainer_no_token_average",
                                           "transformers.Trainer with average_tokens_across_devices=False"),
    "accelerate_docs_loop": Adapter("gradscale.audit.adapters:accelerate_docs_loop",
                                    "Accelerate's accumulate() loop as its guide shows first: the model's mean loss "
                                    "per micro-batch"),
    "accelerate_token_loop": Adapter("gradscale.audit.adapters:accelerate_token_loop",
                                     "Accelerate's example for samples of variable size: the loss over the gathered "
                                     "labels.ne(-100) count, x K x processes"),
    "lightning_docs_loop": Adapter("gradscale.audit.adapters:lightning_docs_loop",
                                   "Lightning's Trainer as its docs show accumulation: the model's mean loss per "
                                   "micro-batch, accumulate_grad_batches=K, DDPStrategy on gloo", requires="lightning"),
    "lightning_token_loop": Adapter("gradscale.audit.adapters:lightning_token_loop",
                                    "Lightning's Trainer with the loss over the global trained-token count, x K x N",
                                    requires="lightning"),
    "deepspeed_docs_loop": Adapter("gradscale.audit.adapters:deepspeed_docs_loop",
                                   "DeepSpeed's loop as its guide shows it: the model's mean loss per micro-batch, "
                                   "engine.backward, ZeRO stage 2 on gloo", requires="deepspeed",
                                   install="DS_BUILD_OPS=0 pip install deepspeed"),
    "deepspeed_token_loop": Adapter("gradscale.audit.adapters:deepspeed_token_loop",
                                    "DeepSpeed ZeRO 2 with the loss over the global trained-token count, x K x N",
                                    requires="deepspeed", install="DS_BUILD_OPS=0 pip install deepspeed"),
    "trl_sft": Adapter("gradscale.audit.adapters:trl_sft",
                       "TRL 1.16.0's SFTTrainer in fp32, gradient_accumulation_steps=K", requires="trl"),
    "torchtune": Adapter("gradscale.audit.adapters:torchtune",
                         "torchtune 0.6.1 full_finetune_distributed's train() on FSDP2 (its fixed scaling)",
                         requires="torchtune"),
    "torchtune_pr2172": Adapter("gradscale.audit.adapters:torchtune_pr2172",
                                "zoo: that step with its factor before PR 2172 (1 / num_tokens: gradients 1/N)",
                                requires="torchtune"),
    **{name: Adapter(f"gradscale.audit.adapters:{name}",
                     f"TRL {'1.9.0 (the release before PR 6024)' if folder else '1.16.0'} GRPOTrainer, "
                     f"loss_type={loss}: {GRPO_LOSS_TYPES[loss]}; use --reference layout",
                     requires="trl", peers=folder)
       for name, (loss, folder) in _grpo_targets().items()},
}


def all_adapters() -> dict[str, Adapter]:
    """The framework adapters, then gradscale's own loop under each recipe of the registry (read when asked)."""
    return {**ADAPTERS, **{name: Adapter(target, summary) for name, (target, summary) in _gradscale_targets().items()}}
