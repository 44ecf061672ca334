"""Each registry is the one source of its list: a throwaway optimizer, recipe and audit adapter, added here, show
up wherever a list is read from it (the tests' cases, --help, the parity oracle's expectations, the audit's
targets), and an optimizer's yaml holds only what differs from its dataclass."""

from __future__ import annotations

import dataclasses

import pytest
from omegaconf import OmegaConf

from gradscale import console, optimizers, parity, recipes
from gradscale.audit import adapters, builtin_targets
from gradscale.audit.adapters import Adapter
from tests.conftest import CONF


def test_a_new_optimizer_entry_is_in_the_tests_and_the_help(monkeypatch):
    from tests.test_train import optimizer_cases

    adamw = optimizers.OPTIMIZERS["adamw"]
    monkeypatch.setitem(optimizers.OPTIMIZERS, "throwaway", dataclasses.replace(adamw, name="throwaway",
                                                                              summary="a throwaway entry"))
    assert optimizer_cases()["throwaway"] == ["optimizer=throwaway"]
    assert "throwaway" in console.help_entries("optimizer", _root_=OmegaConf.create({}))
    assert optimizers.entry("throwaway") is optimizers.OPTIMIZERS["throwaway"]


def test_a_new_recipe_gets_its_parity_expectation_help_line_and_audit_target_from_its_fields(monkeypatch):
    halved = recipes.Recipe("throwaway_tokens", None, divide_by_tokens=True, times_world_size=False,
                            without_fix=None, summary="a throwaway recipe")
    monkeypatch.setitem(recipes.RECIPES, "throwaway_tokens", halved)
    label, passes = parity.expectation("ragged", "throwaway_tokens", 4)
    assert label == "= ref/4" and passes(0.75, 0.25, 1.0) and not passes(0.0, 1.0, 1.0)
    assert "throwaway_tokens" in console.help_entries("normalization", _root_=OmegaConf.create({}))
    assert "gradscale_throwaway_tokens" in builtin_targets()


def test_a_new_adapter_is_a_target_with_what_it_requires(monkeypatch):
    monkeypatch.setitem(adapters.ADAPTERS, "throwaway", Adapter("examples.audit_step:fixed_step", "a throwaway one",
                                                                requires="no_such_peer_framework"))
    assert builtin_targets()["throwaway"] == ("examples.audit_step:fixed_step", "a throwaway one")
    from gradscale.audit import AuditError, resolve_target

    with pytest.raises(AuditError, match="no_such_peer_framework is not installed"):
        resolve_target("throwaway")


@pytest.mark.parametrize("name", optimizers.OPTIMIZERS)
def test_an_optimizer_yaml_holds_only_what_differs_from_its_dataclass(name):
    yaml = OmegaConf.load(CONF / "optimizer" / f"{name}.yaml")
    defaults = {f.name: f.default if f.default is not dataclasses.MISSING else f.default_factory()
                for f in dataclasses.fields(optimizers.OPTIMIZERS[name].config)}
    for key in set(yaml) - {"defaults", "name"}:
        value = OmegaConf.to_container(yaml, resolve=False)[key]
        interpolated = isinstance(value, str) and value.startswith("${")
        assert interpolated or value != defaults[key], f"{name}.yaml repeats {key}={value!r}, its dataclass' default"
