"""What a user reads: `python -m experiments.run --help` as a command's help, Hydra's kept at --hydra-help,
and a help text on every option of every argparse command."""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import re
from unittest import mock

import pytest

from tests.conftest import CONF, ROOT, compose, load_script

GROUPS = ("optimizer", "model", "data", "finetune", "normalization", "experiment", "smoke", "hydra/launcher")


def listed_keys(help_text: str) -> dict[str, str]:
    """The `key=value` lines of the help's key list (the value as printed); not hydra.*'s placeholders."""
    section = help_text.split("Keys (", 1)[1].split("\n\n", 1)[0]
    lines = re.findall(r"^  ([\w.]+)=(\S+)\s{2,}", section, flags=re.MULTILINE)
    return {key: value for key, value in lines if not key.startswith("hydra.")}


def test_help_reads_as_the_commands_help(cli):
    proc = cli(["--help"])
    assert proc.returncode == 0, proc.stderr
    text = proc.stdout
    assert "python -m experiments.run -m optimizer=sgd,adamw scale=1,8" in text  # the user's command
    for example in ("-m experiment=scale_sweep", "smoke=on", "-m hydra/launcher=local_parallel",
                    "python -m experiments.run optimizer=sgd scale=8 steps=50"):
        assert example in text
    for group in GROUPS:
        assert re.search(rf"^  {re.escape(group)} +\S", text, flags=re.MULTILINE), group
    assert "schema/" not in text and "powered by hydra" not in text.lower()
    assert "docs/configuration.md" in text and "README.md" in text and "--hydra-help" in text


def test_help_lists_every_option_of_each_group_and_marks_the_one_in_use(cli):
    text = cli(["optimizer=sgd", "--help"]).stdout
    groups = text.split("Config groups", 1)[1].split("\n\n", 1)[0]
    for group in GROUPS:
        block = re.split(r"\n  \S", groups.split(f"\n  {group} ", 1)[1])[0]  # its description and options
        options = [p.stem for p in (CONF / group).glob("*.yaml")] + (["basic"] if group == "hydra/launcher" else [])
        for option in options:
            assert re.search(rf"\b{option}\b", block), (group, option)
    assert "sgd*" in groups and "adamw*" not in groups and "basic*" in groups and "llama3_2_tiny*" in groups


@pytest.mark.parametrize("overrides", [[], ["optimizer=sgd"], ["optimizer=lion", "scale=8", "fix=false"]])
def test_listed_values_are_the_composed_configs(cli, overrides):
    """Every `key=value` the help lists, read as the override a user would type, is the config's value."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from omegaconf import ListConfig, OmegaConf

    proc = cli([*overrides, "--help"])
    assert proc.returncode == 0, proc.stderr
    keys = listed_keys(proc.stdout)
    assert {"scale", "fix", "world_size", "optimizer.lr", "steps", "batch_size", "seq_len", "clip_grad_norm",
            "precision", "seed", "adam_stats_every", "wandb.mode"} <= keys.keys()
    cfg = compose(overrides)
    parser = OverridesParser.create()
    for key, shown in keys.items():
        value = parser.parse_override(f"{key}={shown}").value()
        expected = OmegaConf.select(cfg, key)
        if isinstance(expected, ListConfig):
            expected = OmegaConf.to_container(expected)
        assert value == expected, (key, shown)
    assert ("optimizer.eps" in keys) == (cfg.optimizer.name == "adamw")


def test_hydra_help_is_still_hydras(cli):
    proc = cli(["--hydra-help"])
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("Hydra (") and "== Flags ==" in proc.stdout
    assert "--hydra-help : Hydra's help" in proc.stdout


class _Parsed(Exception):
    """Raised instead of parsing: the command's parser, built as its main() builds it, is all we need."""


def parser_of(main) -> argparse.ArgumentParser:
    """The ArgumentParser a command's main() builds, caught at its parse_args (nothing runs)."""
    seen = []

    def capture(self, args=None, namespace=None):
        seen.append(self)
        raise _Parsed

    with mock.patch.object(argparse.ArgumentParser, "parse_args", capture), pytest.raises(_Parsed):
        main([])
    return seen[0]


def _script_main(name: str):
    return load_script(name).main


COMMANDS = {
    "analysis.report": lambda: importlib.import_module("analysis.report").main,
    "analysis.notebook": lambda: importlib.import_module("analysis.notebook").main,
    "analysis.advise": lambda: importlib.import_module("analysis.advise").main,
    "analysis.scaling": lambda: importlib.import_module("analysis.scaling").main,
    "experiments.advise": lambda: importlib.import_module("experiments.advise").main,
    "experiments.pretrain": lambda: importlib.import_module("experiments.pretrain").main,
    "experiments.parity": lambda: importlib.import_module("experiments.parity").main,
    "scripts/bench.py": lambda: _script_main("bench"),
    "scripts/device_carry.py": lambda: _script_main("device_carry"),
    "scripts/profile_step.py": lambda: _script_main("profile_step"),
}


@pytest.mark.parametrize("command", COMMANDS)
def test_every_option_of_every_command_has_help(command):
    parser = parser_of(COMMANDS[command]())
    assert parser.description and parser.description.strip(), command
    assert parser.prog.startswith("python "), parser.prog  # as the user types it, not "bench.py"
    for action in parser._actions:
        name = "/".join(action.option_strings) or action.dest
        assert action.help and action.help.strip(), f"{command}: {name} has no help"


def test_the_argparse_commands_are_all_covered():
    """A new command with argparse gets its options' help checked too: add it to COMMANDS."""
    found = set()
    for path in (p for folder in ("analysis", "experiments", "scripts") for p in (ROOT / folder).glob("*.py")):
        if "ArgumentParser(" in path.read_text():
            found.add(f"scripts/{path.name}" if path.parent.name == "scripts" else f"{path.parent.name}.{path.stem}")
    assert found - set(COMMANDS) <= {"analysis.dashboard"}  # its own tests, tests/test_dashboard.py


def test_pretrain_help_lists_the_recipe_with_its_defaults(capsys):
    from dataclasses import fields

    from experiments.config import PretrainConfig
    from experiments.pretrain import main

    with pytest.raises(SystemExit) as exit_:
        main(["--help"])
    assert exit_.value.code == 0
    text = capsys.readouterr().out
    for f in fields(PretrainConfig):
        assert f"model.pretrain.{f.name}={f.default:g} " in text
