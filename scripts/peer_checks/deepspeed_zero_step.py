"""DeepSpeed ZeRO 0/1/2 on CPU, 2 gloo ranks, gradient_accumulation_steps=2, client torch.optim.SGD.

Checks, against a float64 single-process gradient of the mean loss over the whole global batch
(2 ranks x 2 accumulation steps x 2 samples), two things:
  A. the gradient DeepSpeed hands to the (inner) torch optimizer in optimizer.step()
     (the optimizer records grads and does not update; for ZeRO 1/2 its params are this rank's
     flat fp32 partitions, which are all-gathered and unflattened here),
  B. deepspeed.utils.safe_get_full_grad(param) called after the boundary engine.backward(),
     before engine.step().

Usage (in an environment with gradscale, torch 2.13.0 and DS_BUILD_OPS=0 pip install deepspeed==0.19.8):
  DS_ACCELERATOR=cpu OMP_NUM_THREADS=1 torchrun --nproc_per_node 2 \
      scripts/peer_checks/deepspeed_zero_step.py --stage {0,1,2} [--no-allow-untested]
"""


import torch
import torch.distributed as dist

GAS, MICRO = 2, 2
DIN, DH, DOUT = 4, 8, 3


def make_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(DIN, DH), torch.nn.Tanh(), torch.nn.Linear(DH, DOUT))


def global_batch(world):
    g = torch.Generator().manual_seed(123)
    n = world * GAS * MICRO
    return torch.randn(n, DIN, generator=g, dtype=torch.float64), torch.randn(n, DOUT, generator=g, dtype=torch.float64)


class RecordingSGD(torch.optim.SGD):
    """Records the grads of its params at step() and does not update them."""

    recorded = None

    def step(self, closure=None):
        self.recorded = [[None if p.grad is None else p.grad.detach().clone() for p in g["params"]]
                         for g in self.param_groups]


def main(argv: list[str] | None = None) -> None:
    from gradscale.checks import CommandParser

    ap = CommandParser(prog="python -m torch.distributed.run --nproc_per_node 2 "
                            "scripts/peer_checks/deepspeed_zero_step.py",
                       description="DeepSpeed ZeRO's step on CPU gloo ranks against a float64 reference")
    ap.add_argument("--stage", type=int, default=0, choices=[0, 1, 2], help="the ZeRO stage (default 0)")
    ap.add_argument("--no-allow-untested", action="store_true",
                    help="leave out zero_allow_untested_optimizer (shows DeepSpeed's refusal of torch's SGD)")
    ap.add_argument("--local_rank", type=int, default=0, help="set by DeepSpeed's own launcher; unused")
    a = ap.parse_args(argv)

    import deepspeed
    from deepspeed.utils import safe_get_full_grad

    deepspeed.init_distributed(dist_backend="gloo")
    rank, world = dist.get_rank(), dist.get_world_size()

    model = make_model()  # fp32
    ref_model = make_model().double()
    opt = RecordingSGD(model.parameters(), lr=0.0)
    cfg = {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": GAS,
        "train_batch_size": MICRO * GAS * world,
        "zero_optimization": {"stage": a.stage},
        "steps_per_print": 10**9,
    }
    if not a.no_allow_untested:
        cfg["zero_allow_untested_optimizer"] = True
    engine, ds_opt, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=cfg)
    if rank == 0:
        print(f"deepspeed {deepspeed.__version__} stage={a.stage} engine.optimizer={type(engine.optimizer).__name__}"
              f" device={next(engine.module.parameters()).device} dtype={next(engine.module.parameters()).dtype}")

    X, Y = global_batch(world)
    names = [n for n, _ in model.named_parameters()]
    safe = None
    for k in range(GAS):
        lo = (k * world + rank) * MICRO
        x, y = X[lo:lo + MICRO].float(), Y[lo:lo + MICRO].float()
        loss = torch.nn.functional.mse_loss(engine(x), y)  # mean over this micro-batch
        engine.backward(loss)
        if engine.is_gradient_accumulation_boundary():
            safe = {}
            for n, p in engine.module.named_parameters():
                g = safe_get_full_grad(p)  # collective for ZeRO 1/2: call on all ranks
                safe[n] = None if g is None else g.detach().double().clone()
        engine.step()

    # A: what the inner optimizer saw
    inner = engine.optimizer if a.stage == 0 else engine.optimizer.optimizer
    rec = inner.recorded if hasattr(inner, "recorded") else opt.recorded
    handed = {}
    if rec is None:
        handed = None
    elif a.stage == 0:
        for n, g in zip(names, rec[0]):
            handed[n] = g.double()
    else:
        zo = engine.optimizer  # DeepSpeedZeroOptimizer
        for gi, grp in enumerate(zo.bit16_groups):
            part = rec[gi][0].contiguous()
            parts = [torch.empty_like(part) for _ in range(world)]
            dist.all_gather(parts, part)
            flat = torch.cat(parts)
            off = 0
            for p in grp:
                n = names[[id(q) for q in model.parameters()].index(id(p))]
                handed[n] = flat[off:off + p.numel()].view(p.shape).double()
                off += p.numel()

    if rank == 0:
        ref_model.zero_grad()
        # mean over all micro-batches and ranks == mean over the whole global batch (equal sizes)
        torch.nn.functional.mse_loss(ref_model(X), Y).backward()
        ref = {n: p.grad for n, p in ref_model.named_parameters()}

        def report(tag, got):
            if got is None or any(got.get(n) is None for n in names):
                print(f"{tag}: no gradient available ({None if got is None else {n: got[n] is None for n in names}})")
                return
            err = max((got[n] - ref[n]).abs().max().item() for n in names)
            scale = max(ref[n].abs().max().item() for n in names)
            ratio = (sum((got[n] * ref[n]).sum() for n in names) / sum((ref[n] ** 2).sum() for n in names)).item()
            ok = err <= 1e-5 * scale
            print(f"{tag}: max|got-ref|={err:.3e} max|ref|={scale:.3e} <got,ref>/|ref|^2={ratio:.8f} "
                  f"{'MATCH' if ok else 'MISMATCH'}")

        report(f"stage{a.stage} A handed-to-optimizer", handed)
        report(f"stage{a.stage} B safe_get_full_grad  ", safe)
    dist.barrier()


if __name__ == "__main__":
    main()
