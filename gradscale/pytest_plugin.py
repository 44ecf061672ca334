"""pytest plugin (installed with gradscale, registered under pytest11): the audit from a project's own test suite.

    def test_my_step_hands_the_optimizer_the_right_gradient(gradient_audit):
        gradient_audit("my_project.train:step")

The fixture runs `gradscale-audit` on the step (real gloo ranks, N = 1, 2, 4, with and without accumulation,
unless told) and fails the test with the audit's table when any configuration does not give the one-process
gradient of the global token-mean loss. pytest loads this module in every session of an environment that has
gradscale: it imports nothing until a test asks for the fixture.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import pytest


@pytest.fixture
def gradient_audit() -> Callable[..., list]:
    """gradient_audit(target, world_sizes=(1, 2, 4), accumulations=(1, 4), tolerance=1e-4, objective="token-mean",
    reference="objective", model_spec=None): the audit's results; an AssertionError with its table when a
    configuration fails (gradscale.audit.assert_gradient_matches)."""

    def run(target: str, world_sizes: Sequence[int] = (1, 2, 4), accumulations: Sequence[int] = (1, 4),
            tolerance: float | None = None, objective: str = "token-mean", reference: str = "objective",
            model_spec: str | None = None) -> list:
        from gradscale.audit import TOLERANCE, assert_gradient_matches

        return assert_gradient_matches(target, world_sizes, accumulations,
                                       TOLERANCE if tolerance is None else tolerance, objective, reference,
                                       model_spec)

    return run
