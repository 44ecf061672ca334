"""The embedded dataset, the tokenizer, loss masking, packing and local JSONL files."""

from __future__ import annotations

import json

import pytest
import torch

from gradscale import data
from gradscale.data import IGNORE_INDEX
from tests.conftest import compose


def cfg_for(overrides):
    from gradscale.hydra_glue import to_object

    return to_object(compose(overrides))


@pytest.fixture(scope="module")
def tokenizer(cache_dir):
    return data.build_tokenizer(data.pydoc_examples(), 2048, None)


def test_pydoc_dataset_covers_the_cpython_reference():
    from pydoc_data.topics import topics

    examples = data.pydoc_examples()
    assert len(topics) == 79
    assert all(any(f"'{t}'" in e["prompt"] for e in examples) for t in topics)
    assert sum(len(e["response"]) for e in examples) > 400_000
    assert len({e["prompt"] for e in examples}) == len(examples)


def test_docstrings_dataset_is_the_standard_librarys_docstrings():
    from gradscale.hydra_glue import to_object

    examples = data.load_examples(to_object(compose(["data=docstrings"])).data)
    assert len(examples) > 4000  # 5824 on CPython 3.11
    assert all(len(e["response"]) >= data.MIN_DOCSTRING_CHARS for e in examples)
    prompts = {e["prompt"] for e in examples}
    assert "Write the docstring of the module json." in prompts
    assert "Write the docstring of the function dumps in the module json." in prompts
    assert "Write the docstring of the function JSONEncoder.default in the module json.encoder." in prompts  # methods
    import json as json_module

    response = next(e["response"] for e in examples if e["prompt"].endswith("function dumps in the module json."))
    assert response == json_module.dumps.__doc__.strip().replace("\n    ", "\n")
    train, held_out = data.split_examples(examples, 0.05)
    assert len(held_out) == round(0.05 * len(examples)) and not {id(e) for e in train} & {id(e) for e in held_out}


def test_tokenizer_is_deterministic_and_cached(tmp_path):
    examples = data.pydoc_examples()[:200]
    a = data.build_tokenizer(examples, 512, str(tmp_path / "a"))
    b = data.build_tokenizer(examples, 512, str(tmp_path / "b"))
    assert a.get_vocab() == b.get_vocab() and len(a) == 512
    assert len(list((tmp_path / "a").glob("tokenizer-*.json"))) == 1
    c = data.build_tokenizer(examples, 512, str(tmp_path / "a"))  # from the cache
    assert c.get_vocab() == a.get_vocab()
    assert a.decode(a("x = [1, 2]", add_special_tokens=False)["input_ids"]) == "x = [1, 2]"


def build(overrides, tokenizer):
    cfg = cfg_for(overrides)
    examples = data.load_examples(cfg.data)
    return data.build_batches(examples, cfg.data, tokenizer, cfg.seq_len, cfg.batch_size, cfg.seed)


def test_prompt_tokens_are_masked_unless_train_on_input(tokenizer):
    masked = build(["seq_len=128"], tokenizer)
    unmasked = build(["seq_len=128", "data.train_on_input=true"], tokenizer)
    trained_masked = (masked.train.targets != IGNORE_INDEX).sum(1)
    trained_all = (unmasked.train.targets != IGNORE_INDEX).sum(1)
    assert (trained_masked < trained_all).all()  # every prompt has tokens
    assert len(set(trained_masked.tolist())) > 10  # counts vary between sequences
    # targets are the next input token wherever they are trained
    row = unmasked.train
    trained = (row.targets[:, :-1] != IGNORE_INDEX) & (row.inputs[:, 1:] != tokenizer.pad_token_id)
    assert torch.equal(row.targets[:, :-1][trained], row.inputs[:, 1:][trained])
    untruncated = (row.inputs == tokenizer.pad_token_id).any(1)
    assert (row.targets == tokenizer.eos_token_id).any(1)[untruncated].all()  # eos: trained, never an input
    # the first trained target of a masked row is the first response token, after "### Response:\n"
    first = (masked.train.targets[0] != IGNORE_INDEX).nonzero()[0].item()
    assert tokenizer.decode(masked.train.inputs[0, : first + 1]).endswith("### Response:\n")


def test_packed_rows_are_full(tokenizer):
    packed = build(["seq_len=128", "data.packed=true"], tokenizer)
    assert (packed.train.inputs != tokenizer.pad_token_id).all()
    unpacked = build(["seq_len=128"], tokenizer)
    assert (unpacked.train.inputs == tokenizer.pad_token_id).any()


def test_held_out_split_is_fixed_and_disjoint(tokenizer):
    examples = data.pydoc_examples()
    train_a, eval_a = data.split_examples(examples, 0.05)
    train_b, eval_b = data.split_examples(examples, 0.05)
    assert eval_a == eval_b and len(train_a) + len(eval_a) == len(examples)
    assert not {e["prompt"] for e in eval_a} & {e["prompt"] for e in train_a}


def test_local_jsonl_file(tmp_path, tokenizer):
    path = tmp_path / "train.jsonl"
    records = [{"prompt": f"Question {i}: what is {i} + {i}?", "response": f"It is {2 * i}."} for i in range(40)]
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    cfg = cfg_for(["data=jsonl", f"data.path={path}"])
    assert data.load_examples(cfg.data) == records
    batches = build(["data=jsonl", f"data.path={path}", "batch_size=8"], tokenizer)
    assert len(batches.train) + len(batches.eval) == 40


def test_jsonl_records_without_the_fields_are_refused(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps({"question": "q", "answer": "a"}) + "\n")
    with pytest.raises(data.DataError, match="record 0 has no text field 'prompt'"):
        data.load_examples(cfg_for(["data=jsonl", f"data.path={path}"]).data)


def test_seq_len_too_short_for_every_prompt_is_refused(tokenizer):
    with pytest.raises(data.DataError, match="seq_len=4 leaves no sequence"):
        build(["seq_len=4"], tokenizer)


def test_hf_data_loads_through_datasets_from_a_local_dataset_dir(tmp_path, tokenizer):
    """data=hf goes through datasets.load_dataset(NAME); a local folder of JSON files stands in for the hub."""
    folder = tmp_path / "my_dataset"
    folder.mkdir()
    records = [{"instruction": f"Say {i}.", "output": f"{i}"} for i in range(30)]
    (folder / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    overrides = ["data=hf", f"data.hf_name={folder}", "data.prompt_field=instruction", "data.response_field=output"]
    examples = data.load_examples(cfg_for(overrides).data)
    assert examples == [{"prompt": r["instruction"], "response": r["output"]} for r in records]


def test_tokenized_splits_are_reused_only_for_the_same_content(tokenizer, tmp_path, monkeypatch):
    examples = data.pydoc_examples()[:300]
    calls = []
    encode = data.encode_examples
    monkeypatch.setattr(data, "encode_examples", lambda *a: calls.append(1) or encode(*a))
    monkeypatch.setattr(data, "_TOKENIZED", {})

    def split(examples=examples, tok=tokenizer, train_on_input=False, seq_len=64, packed=False):
        return data.tokenize_split(examples, tok, train_on_input, seq_len, packed, "alpaca")

    first = split()
    same_tokenizer_again = data.build_tokenizer(data.pydoc_examples(), 2048, None)  # a new object, same content
    assert split(tok=same_tokenizer_again) is first and len(calls) == 1  # a later job of the sweep
    fresh = data.to_sequences(encode(examples, tokenizer, False), 64, False, tokenizer.pad_token_id)
    assert torch.equal(first.inputs, fresh.inputs) and torch.equal(first.targets, fresh.targets)
    edited = [dict(examples[0], response="!" + examples[0]["response"]), *examples[1:]]
    other_tokenizer = data.build_tokenizer(examples, 512, str(tmp_path))
    variants = [split(train_on_input=True), split(seq_len=65), split(packed=True), split(examples=edited),
                split(tok=other_tokenizer)]
    assert len(calls) == 6 and all(v is not first for v in variants)  # every setting and content counts
    assert not torch.equal(split(examples=edited).targets, first.targets)
