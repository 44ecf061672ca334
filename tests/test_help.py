"""What a user reads: `gradscale-run --help` as a command's help, Hydra's kept at --hydra-help,
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
    assert "python -m experiments.run -m optimizer=sgd,adamw scale=1,8" in text  # the user's command, from a clone
    assert "gradscale-run -m optimizer=sgd,adamw scale=1,8" in text  # installed
    for example in ("-m experiment=scale_sweep", "smoke=on", "-m hydra/launcher=local_parallel",
                    "gradscale-run optimizer=sgd scale=8 steps=50"):
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


def test_help_says_which_model_presets_have_pretrained_weights(cli):
    """Read from each preset's file: the 1B/3B presets are random weights (a user expecting Llama's would
    otherwise find out from the loss)."""
    from omegaconf import OmegaConf

    text = cli(["--help"]).stdout
    for path in sorted((CONF / "model").glob("*.yaml")):
        line = re.search(rf"^ +{path.stem}\*? +(.+)$", text, flags=re.MULTILINE)
        assert line, path.stem
        random_init = OmegaConf.load(path).get("init") == "random"
        assert line.group(1).startswith("random weights" if random_init else "pretrained:"), line.group(0)
    assert re.search(r"^ +llama3_2_3b +random weights: the real ones need model.path=DIR", text, flags=re.MULTILINE)


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

    # parse_known_args: what parse_args and parse_intermixed_args both end in
    with mock.patch.object(argparse.ArgumentParser, "parse_known_args", capture), pytest.raises(_Parsed):
        main([])
    return seen[0]


def _script_main(name: str):
    return load_script(name).main


COMMANDS = {
    "gradscale.analysis.report": lambda: importlib.import_module("gradscale.analysis.report").main,
    "gradscale.analysis.dashboard": lambda: importlib.import_module("gradscale.analysis.dashboard").main,
    "gradscale.audit": lambda: importlib.import_module("gradscale.audit.__main__").main,
    "gradscale.analysis.notebook": lambda: importlib.import_module("gradscale.analysis.notebook").main,
    "gradscale.analysis.advise": lambda: importlib.import_module("gradscale.analysis.advise").main,
    "gradscale.analysis.scaling": lambda: importlib.import_module("gradscale.analysis.scaling").main,
    "gradscale.advise": lambda: importlib.import_module("gradscale.advise").main,
    "gradscale.pretrain": lambda: importlib.import_module("gradscale.pretrain").main,
    "gradscale.parity": lambda: importlib.import_module("gradscale.parity").main,
    "scripts/bench.py": lambda: _script_main("bench"),
    "scripts/device_carry.py": lambda: _script_main("device_carry"),
    "scripts/profile_step.py": lambda: _script_main("profile_step"),
    "scripts.peer_checks.deepspeed_zero_step": lambda: _script_main("peer_checks/deepspeed_zero_step"),
    "scripts.peer_checks.verl_actor_step": lambda: _script_main("peer_checks/verl_actor_step"),
}


@pytest.mark.parametrize("command", COMMANDS)
def test_every_option_of_every_command_has_help(command):
    parser = parser_of(COMMANDS[command]())
    assert parser.description and parser.description.strip(), command
    assert parser.prog.startswith(("python ", "gradscale-")), parser.prog  # as the user types it, not "bench.py"
    for action in parser._actions:
        name = "/".join(action.option_strings) or action.dest
        assert action.help and action.help.strip(), f"{command}: {name} has no help"


def test_the_argparse_commands_are_all_covered():
    """A new command gets its options' help and its bad flags checked too: add it to COMMANDS (and BAD_FLAGS)."""
    found = set()
    for path in (p for folder in ("gradscale", "scripts") for p in (ROOT / folder).rglob("*.py")):
        if "CommandParser(" in path.read_text() and path.name != "checks.py":
            module = ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__main__")
            found.add(f"scripts/{path.name}" if path.parent.name == "scripts" else module)
        assert "argparse.ArgumentParser(" not in path.read_text() or path.name == "checks.py", path  # one line
    assert found == set(COMMANDS) and found == {command for command, _, _ in BAD_FLAGS}


def test_pretrain_help_lists_the_recipe_with_its_defaults(capsys):
    from dataclasses import fields

    from gradscale.config import PretrainConfig
    from gradscale.pretrain import main

    with pytest.raises(SystemExit) as exit_:
        main(["--help"])
    assert exit_.value.code == 0
    text = capsys.readouterr().out
    for f in fields(PretrainConfig):
        assert f"model.pretrain.{f.name}={f.default:g} " in text


# every command (gradscale.run's config values: test_cli.py), each bad flag: (command, argv, what the line says);
# MISSING is a path that does not exist, OUT a folder that must not appear, BLOCKED a path under a plain file
BAD_FLAGS = [
    ("gradscale.analysis.report", ["SWEEP", "--bogus"], "unrecognized arguments: --bogus"),
    ("gradscale.analysis.report", ["MISSING"], "MISSING does not exist"),
    ("gradscale.analysis.report", ["SWEEP", "--out", "BLOCKED"], "--out='BLOCKED' cannot be written"),
    ("gradscale.analysis.report", ["SWEEP", "--wandb-mode", "sometimes"], "--wandb-mode: invalid choice: 'sometimes'"),
    ("gradscale.analysis.dashboard", ["SWEEP", "--bogus"], "unrecognized arguments: --bogus"),
    ("gradscale.analysis.dashboard", ["MISSING", "--dry-run"], "MISSING does not exist"),
    ("gradscale.analysis.scaling", ["SWEEP", "--bogus"], "unrecognized arguments: --bogus"),
    ("gradscale.analysis.scaling", ["MISSING"], "sweep folder 'MISSING' does not exist"),
    ("gradscale.analysis.scaling", ["SWEEP", "--eps=-1"], "--eps=-1.0 must be > 0"),
    ("gradscale.analysis.scaling", ["SWEEP", "--out", "BLOCKED"], "--out='BLOCKED' cannot be written"),
    ("gradscale.analysis.scaling", ["SWEEP", "--point", "MISSING"], "--point='MISSING' is not a run folder"),
    ("gradscale.analysis.notebook", ["NOTEBOOK", "SWEEP", "--bogus"], "unrecognized arguments: --bogus"),
    ("gradscale.analysis.notebook", ["MISSING", "SWEEP"], "MISSING is not a notebook"),
    ("gradscale.analysis.advise", ["SWEEP", "--bogus"], "unrecognized arguments: --bogus"),
    ("gradscale.analysis.advise", ["MISSING"], "run folder 'MISSING' does not exist"),
    ("gradscale.advise", ["--bogus"], "unrecognized arguments: --bogus"),
    ("gradscale.advise", ["--world-sizes", "8,abc"], "--world-sizes='8,abc' is not a comma-separated list"),
    ("gradscale.advise", ["--eps=0"], "--eps=0.0 must be > 0"),
    ("gradscale.advise", ["--json", "BLOCKED"], "--json='BLOCKED'"),
    ("gradscale.advise", ["scale=8"], "scale=8 is not allowed"),
    ("gradscale.advise", ["optimizer=sgd"], "optimizer=sgd is not allowed"),
    ("gradscale.advise", ["--gradient-only", "optimizer=bogus"], "optimizer=bogus is not allowed"),
    ("gradscale.advise", ["--gradient-only", "steps=0"], "steps=0 is not allowed"),
    ("gradscale.advise", ["--gradient-only", "model=gpt2"], "model=gpt2 is not allowed: one of"),
    ("gradscale.audit", ["global_token_mean", "--bogus"], "unrecognized arguments: --bogus"),
    ("gradscale.audit", ["nope"], "target 'nope' is neither a built-in target"),
    ("gradscale.audit", ["global_token_mean", "--world-sizes", "3"], "--world-sizes 3: each must be one of"),
    ("gradscale.parity", ["--bogus"], "unrecognized arguments: --bogus"),
    ("gradscale.parity", ["--world-size", "1"], "--world-size: invalid choice: 1"),
    ("gradscale.pretrain", ["--bogus"], "--bogus"),
    ("gradscale.pretrain", ["model.pretrain.steps=-1"], "model.pretrain.steps=-1 is not allowed"),
    ("scripts/bench.py", ["--bogus"], "unrecognized arguments: --bogus"),
    ("scripts/bench.py", ["--steps", "0"], "--steps=0 must be >= 1"),
    ("scripts/profile_step.py", ["--bogus"], "unrecognized arguments: --bogus"),
    ("scripts/device_carry.py", ["--bogus"], "unrecognized arguments: --bogus"),
    ("scripts.peer_checks.deepspeed_zero_step", ["--stage", "3"], "--stage: invalid choice: 3"),
    ("scripts.peer_checks.verl_actor_step", ["--wrap", "fsdp"], "--wrap: invalid choice: 'fsdp'"),
]


@pytest.mark.parametrize(("command", "argv", "says"), BAD_FLAGS, ids=[f"{c} {' '.join(a)}" for c, a, _ in BAD_FLAGS])
def test_every_command_refuses_each_bad_flag_in_one_line_before_any_work(tmp_path, capsys, monkeypatch, command,
                                                                         argv, says):
    sweep, out = tmp_path / "sweep", tmp_path / "out"
    sweep.mkdir()
    (tmp_path / "a_file").write_text("")
    paths = {"MISSING": str(tmp_path / "missing"), "SWEEP": str(sweep), "BLOCKED": str(tmp_path / "a_file" / "x"),
             "NOTEBOOK": str(ROOT / "gradscale" / "analysis" / "notebooks" / "01_world_size_fix.py")}
    argv = [paths.get(a, a) for a in argv] + (["--out", str(out)] if command == "gradscale.analysis.dashboard" else [])
    if command.startswith("experiments.") and command not in ("gradscale.audit", "gradscale.parity"):
        argv.append(f"hydra.run.dir={out}")
    says = paths["MISSING"].join(paths["BLOCKED"].join(says.split("BLOCKED")).split("MISSING"))
    monkeypatch.chdir(tmp_path)  # anything a command would write by default lands here, where it is looked for
    main = COMMANDS[command]()
    try:
        code = main(argv)
    except SystemExit as e:
        code = e.code
    captured = capsys.readouterr()
    assert code == 2, (code, captured.err)
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and says in lines[0], captured.err
    assert not out.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["a_file", "sweep"]
    assert not any(sweep.iterdir())
