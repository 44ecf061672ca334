"""verl 0.9.1 actor gradient step on CPU, 2 gloo ranks.

verl 0.9.1 has no DataParallelPPOActor (verl/workers/actor/ was removed; the actor
update runs through TrainingWorker.train_mini_batch -> BaseEngine.train_batch ->
FSDPEngine.forward_backward_batch -> loss_fn = partial(ppo_loss, config=actor_config)).

This script drives that real code path:
  * BaseEngine.train_batch            (zero_grad, forward_backward_batch, optimizer_step)
  * FSDPEngine.forward_backward_batch (all_reduce of loss_mask token count over dp,
                                       assign dp_size, prepare_micro_batches, backward per micro-batch)
  * FSDPEngine.optimizer_step         (clip_grad_norm_, optimizer.step())
  * verl.workers.utils.losses.ppo_loss -> core_algos.compute_policy_loss_vanilla -> agg_loss
Only FSDPEngine.__init__ (needs an HF checkpoint + CUDA) and forward_step (HF model call)
are replaced: the module is a tiny float64 LM wrapped in DDP (or FSDP2 fully_shard with --wrap fsdp2),
and forward_step produces the same jagged nested "log_probs" that FSDPEngineWithLMHead produces.

The optimizer records p.grad in step() instead of updating, so the gradient verl hands to
the optimizer is compared with a float64 single-process reference of the global-batch loss.

One shim is needed on CPU: transformer_impl.get_device_id is patched to return 'cpu' (see run()).

Usage (in an environment with gradscale, torch 2.13.0 and pip install verl==0.9.1):
  OMP_NUM_THREADS=1 python scripts/peer_checks/verl_actor_step.py [--wrap ddp|fsdp2] [--no-shim]
"""

import os
import socket
import sys
from types import SimpleNamespace

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

V, H, P, R = 13, 8, 3, 5  # vocab, hidden, prompt len, response len
WORLD = 2
MINI_PER_RANK = 4  # ppo_mini_batch_size (global) = 8 sequences
MICRO = 2  # ppo_micro_batch_size_per_gpu -> 2 micro-batches per rank
MODES = ["token-mean", "token-sum", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"]
CLIP = 0.2


class TinyLM(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(V, H)
        self.out = torch.nn.Linear(H, V)

    def forward(self, input_ids):
        return self.out(torch.tanh(self.emb(input_ids)))


def make_global_batch():
    g = torch.Generator().manual_seed(0)
    B = WORLD * MINI_PER_RANK
    prompts = torch.randint(0, V, (B, P), generator=g)
    responses = torch.randint(0, V, (B, R), generator=g)
    resp_len = torch.tensor([5, 2, 4, 1, 3, 5, 5, 2])  # uneven valid lengths per sequence
    response_mask = (torch.arange(R)[None, :] < resp_len[:, None]).to(torch.float64)
    advantages = torch.randn(B, R, generator=g, dtype=torch.float64)
    return prompts, responses, response_mask, advantages


def token_logprobs(model, prompts, responses):
    """Log-prob of each response token: shape (B, R)."""
    input_ids = torch.cat([prompts, responses], dim=1)
    logits = model(input_ids)
    lp = torch.log_softmax(logits, dim=-1)
    labels = torch.roll(input_ids, shifts=-1, dims=1)
    full = lp.gather(-1, labels.unsqueeze(-1)).squeeze(-1)  # position t -> log p(token t+1)
    return full, full[:, P - 1 : P + R - 1]


def old_logprobs(model, prompts, responses):
    with torch.no_grad():
        _, cur = token_logprobs(model, prompts, responses)
    g = torch.Generator().manual_seed(1)
    return cur + 0.3 * torch.randn(cur.shape, generator=g, dtype=torch.float64)  # some tokens get clipped


def reference_grads(model, mode):
    """Single process float64, hand-written PPO clipped loss over the whole global mini-batch."""
    prompts, responses, mask, adv = make_global_batch()
    old = old_logprobs(model, prompts, responses)
    model.zero_grad()
    _, lp = token_logprobs(model, prompts, responses)
    ratio = torch.exp(torch.clamp(lp - old, -20, 20))
    l1 = -adv * ratio
    l2 = -adv * torch.clamp(ratio, 1 - CLIP, 1 + CLIP)
    c1 = torch.maximum(l1, l2)
    c2 = torch.min(-adv * 3.0, c1)
    pg = torch.where(adv < 0, c2, c1)
    nseq = mask.shape[0]
    if mode == "token-mean":
        loss = (pg * mask).sum() / mask.sum()
    elif mode == "token-sum":
        loss = (pg * mask).sum()
    elif mode == "seq-mean-token-mean":
        loss = ((pg * mask).sum(-1) / mask.sum(-1)).sum() / nseq
    elif mode == "seq-mean-token-sum":
        loss = (pg * mask).sum(-1).sum() / nseq
    elif mode == "seq-mean-token-sum-norm":
        loss = (pg * mask).sum(-1).sum() / nseq / R
    loss.backward()
    return {n: p.grad.detach().clone() for n, p in model.named_parameters()}


def run(rank, port, wrap, shim, out_q):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(WORLD))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    torch.manual_seed(0)

    from functools import partial

    from tensordict import TensorDict
    from verl.utils import tensordict_utils as tu
    from verl.workers.config.actor import FSDPActorConfig
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngine
    from verl.workers.utils.losses import ppo_loss

    if shim:
        # verl 0.9.1 has no CPU platform: with no accelerator it falls back to 'nvidia', and
        # forward_backward_batch (transformer_impl.py:730) calls get_device_id() ->
        # torch.cuda.current_device() -> "AssertionError: Torch not compiled with CUDA enabled".
        # Under FSDP2 the same happens in optimizer_step -> fsdp2_clip_grad_norm_ (fsdp_utils.py:640).
        import verl.utils.fsdp_utils as fu
        import verl.workers.engine.fsdp.transformer_impl as ti

        ti.get_device_id = lambda: "cpu"
        fu.get_device_id = lambda: "cpu"

    class RecordingSGD(torch.optim.SGD):
        """step() records the gradient verl hands to the optimizer and does not update."""

        recorded = None

        def step(self, closure=None):
            self.recorded = []
            for grp in self.param_groups:
                for p in grp["params"]:
                    gr = p.grad
                    if hasattr(gr, "full_tensor"):
                        gr = gr.full_tensor()
                    self.recorded.append(gr.detach().clone())

    class CPUEngine(FSDPEngine):
        """FSDPEngine with __init__ bypassed (as verl's VeOmniEngine does) and a tiny-LM forward_step."""

        def __init__(self, module, optimizer):  # noqa: D401 - deliberately not calling FSDPEngine.__init__
            self.module = module
            self.optimizer = optimizer
            self.optimizer_config = SimpleNamespace(clip_grad=1e9)  # effectively no clipping
            self.engine_config = SimpleNamespace(use_no_sync_for_gradient_accumulation=True)
            self.ulysses_sequence_parallel_size = 1
            self.ulysses_device_mesh = None
            self._qat_enabled = False
            self.scaler = None

        def forward_step(self, micro_batch, loss_function, forward_only):
            full, _ = token_logprobs(self.module, micro_batch["prompts"], micro_batch["responses"])
            B, T = full.shape
            offsets = torch.arange(0, B + 1) * T
            log_probs = torch.nested.nested_tensor_from_jagged(full.reshape(-1), offsets)
            model_output = {"log_probs": log_probs}
            loss, metrics = loss_function(
                model_output=model_output, data=micro_batch, dp_group=self.get_data_parallel_group()
            )
            return loss, {"model_output": {"log_probs": log_probs.detach()}, "loss": loss.detach().item(),
                          "metrics": metrics}

    base = TinyLM().double()
    ref_model = TinyLM().double()
    ref_model.load_state_dict(base.state_dict())
    if wrap == "ddp":
        module = torch.nn.parallel.DistributedDataParallel(base)
    else:
        from torch.distributed.fsdp import fully_shard

        fully_shard(base)
        module = base
    names = [n for n, _ in ref_model.named_parameters()]

    prompts, responses, mask, adv = make_global_batch()
    old = old_logprobs(ref_model, prompts, responses)
    sl = slice(rank * MINI_PER_RANK, (rank + 1) * MINI_PER_RANK)

    results = {}
    for mode in MODES:
        opt = RecordingSGD(module.parameters(), lr=0.0)
        eng = CPUEngine(module, opt)
        cfg = FSDPActorConfig(strategy="fsdp", rollout_n=1, ppo_mini_batch_size=WORLD * MINI_PER_RANK,
                              ppo_micro_batch_size_per_gpu=MICRO, loss_agg_mode=mode, clip_ratio=CLIP,
                              use_torch_compile=False)
        td = TensorDict(
            {
                "prompts": prompts[sl],
                "responses": responses[sl],
                "input_ids": torch.cat([prompts[sl], responses[sl]], 1),
                "attention_mask": torch.ones(MINI_PER_RANK, P + R, dtype=torch.long),
                "response_mask": mask[sl],
                "loss_mask": mask[sl],
                "old_log_probs": old[sl],
                "advantages": adv[sl],
            },
            batch_size=[MINI_PER_RANK],
        )
        # what TrainingWorker.train_batch / the PPO trainer put on the batch
        tu.assign_non_tensor(td, global_batch_size=WORLD * MINI_PER_RANK, use_dynamic_bsz=False,
                             micro_batch_size_per_gpu=MICRO, use_remove_padding=False, use_fused_kernels=False)
        out = eng.train_batch(td, loss_function=partial(ppo_loss, config=cfg))  # BaseEngine.train_batch
        got = dict(zip(names, opt.recorded))
        if rank == 0:
            ref = reference_grads(ref_model, mode)
            err = max((got[n] - ref[n]).abs().max().item() for n in names)
            scale = max(ref[n].abs().max().item() for n in names)
            ratio = (sum((got[n] * ref[n]).sum() for n in names) / sum((ref[n] ** 2).sum() for n in names)).item()
            results[mode] = (err, scale, ratio, out["metrics"]["grad_norm"])
    if rank == 0:
        out_q.put(results)
    dist.barrier()
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> None:
    from gradscale.checks import CommandParser

    ap = CommandParser(prog="python scripts/peer_checks/verl_actor_step.py",
                       description="verl 0.9.1's actor step on 2 CPU gloo ranks against a float64 reference")
    ap.add_argument("--wrap", default="ddp", choices=["ddp", "fsdp2"], help="the data-parallel wrapper (default ddp)")
    ap.add_argument("--no-shim", action="store_true", help="do not patch get_device_id (shows the CUDA error)")
    a = ap.parse_args(argv)
    torch.set_default_dtype(torch.float64)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    q = ctx.SimpleQueue()
    mp.start_processes(run, args=(port, a.wrap, not a.no_shim, q), nprocs=WORLD, start_method="spawn")
    res = q.get()
    print(f"wrap={a.wrap} world={WORLD} mini/rank={MINI_PER_RANK} micro={MICRO}")
    print(f"{'loss_agg_mode':26s} {'max|verl-ref|':>14s} {'max|ref|':>10s} {'<g,ref>/|ref|^2':>16s} grad_norm")
    for m, (err, scale, ratio, gn) in res.items():
        print(f"{m:26s} {err:14.3e} {scale:10.3e} {ratio:16.12f} {gn:.6f}")
    ok = all(err <= 1e-12 * max(1.0, scale) for err, scale, _, _ in res.values())
    print("ALL MATCH" if ok else "MISMATCH")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
