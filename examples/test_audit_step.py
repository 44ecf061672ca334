"""The audit from a project's own tests: gradscale's pytest plugin gives every test suite in its environment the
`gradient_audit` fixture, one line per step (here examples/audit_step.py's two)."""

import pytest


@pytest.mark.distributed
def test_the_fixed_step_hands_its_optimizer_the_right_gradient(gradient_audit):
    gradient_audit("examples.audit_step:fixed_step", world_sizes=(1, 2))  # default: N = 1, 2, 4


@pytest.mark.distributed
def test_the_buggy_step_is_caught(gradient_audit):
    with pytest.raises(AssertionError, match=r"N=1 K=4: gradient x0.25 the global token-mean's"):
        gradient_audit("examples.audit_step:step", world_sizes=(1,))  # one rank is enough to catch it
