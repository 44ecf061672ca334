"""`gradscale.run` with rank 1 raising at step 2: for the dead-rank test under torchrun."""

import os

from gradscale import grads
from gradscale.run import main

real_apply = grads.GradPipeline.apply
calls = {"n": 0}


def apply_then_fail_on_rank_1(self, *args, **kwargs):
    calls["n"] += 1
    if os.environ.get("RANK") == "1" and calls["n"] == 3:
        raise RuntimeError("injected failure on rank 1 at step 2")
    return real_apply(self, *args, **kwargs)


grads.GradPipeline.apply = apply_then_fail_on_rank_1

if __name__ == "__main__":
    main()
