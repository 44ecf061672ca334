"""The Llama 3.2 architecture, the real 1B/3B dimensions, and loading a local checkpoint."""

from __future__ import annotations

import json

import pytest
import torch

from tests.conftest import compose, run_in_process, train_records


def build(overrides, device="cpu"):
    from gradscale.hydra_glue import to_object
    from gradscale.model import build_model

    cfg = to_object(compose(overrides))
    return build_model(cfg.model, cfg.seed, torch.device(device)), cfg


def test_tiny_default_has_the_llama_3_2_architecture():
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    net, cfg = build([])
    config = net.config
    assert config.num_key_value_heads < config.num_attention_heads  # grouped-query attention
    assert config.rope_parameters["rope_type"] == "llama3"
    assert config.rope_parameters["factor"] == 32.0
    assert config.tie_word_embeddings and net.lm_head.weight is net.model.embed_tokens.weight
    assert isinstance(net.model.norm, LlamaRMSNorm)
    assert config.hidden_act == "silu" and hasattr(net.model.layers[0].mlp, "gate_proj")  # SwiGLU
    assert net.model.layers[0].self_attn.k_proj.out_features == config.num_key_value_heads * config.head_dim


@pytest.mark.parametrize(("name", "billions"), [("llama3_2_1b", 1.236), ("llama3_2_3b", 3.213)])
def test_real_configs_carry_the_published_dimensions(name, billions):
    from transformers import LlamaForCausalLM

    from gradscale.hydra_glue import to_object
    from gradscale.model import llama_config

    cfg = to_object(compose([f"model={name}"]))
    with torch.device("meta"):  # the real size, without allocating it
        net = LlamaForCausalLM(llama_config(cfg.model))
    assert sum(p.numel() for p in net.parameters()) / 1e9 == pytest.approx(billions, abs=0.005)
    assert net.config.vocab_size == 128256 and net.config.max_position_embeddings == 131072


def test_same_seed_same_init_different_seed_different_init():
    a, _ = build(["seed=3"])
    b, _ = build(["seed=3"])
    c, _ = build(["seed=4"])
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters()))
    assert not torch.equal(a.model.embed_tokens.weight, c.model.embed_tokens.weight)


@pytest.fixture
def checkpoint(tmp_path, cache_dir):
    """A tiny model and its tokenizer saved with save_pretrained, as a user's local checkpoint."""
    from gradscale import data

    net, cfg = build(["seed=7"])
    tokenizer = data.build_tokenizer(data.load_examples(cfg.data), cfg.data.tokenizer_vocab_size, None)
    path = tmp_path / "checkpoint"
    net.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path, net, tokenizer


def test_model_path_loads_weights_and_tokenizer(checkpoint):
    from gradscale.model import build_model, load_tokenizer
    from gradscale.weights import checkpoint_dir

    path, saved, saved_tokenizer = checkpoint
    _, cfg = build([f"model.path={path}"])
    loaded = build_model(cfg.model, seed=0, device=torch.device("cpu"), checkpoint=checkpoint_dir(cfg.model))
    for (name, x), (_, y) in zip(saved.state_dict().items(), loaded.state_dict().items()):
        assert torch.equal(x, y), name
    tokenizer = load_tokenizer(str(path))
    text = "The 'if' statement is used for conditional execution."
    assert tokenizer(text)["input_ids"] == saved_tokenizer(text)["input_ids"]
    assert tokenizer.eos_token == saved_tokenizer.eos_token


def test_lora_on_a_checkpoint_starts_the_same_whatever_ran_before(checkpoint):
    """A sweep runs its jobs in one process: a fix-off run must start from the adapters of its fix-on
    reference, not from wherever the RNG was left by the job before (the step-0 grad-norm ratio
    read 0.113 for 0.125 when it did)."""
    from gradscale.model import apply_finetune, build_model
    from gradscale.weights import checkpoint_dir

    path, _, _ = checkpoint
    _, cfg = build([f"model.path={path}", "finetune=lora"])
    adapters = []
    for draws_before in (0, 1000):
        torch.rand(draws_before)
        net = apply_finetune(build_model(cfg.model, cfg.seed, torch.device("cpu"), checkpoint_dir(cfg.model)),
                             cfg.finetune)
        adapters.append({n: p.detach().clone() for n, p in net.named_parameters() if p.requires_grad})
    assert adapters[0].keys() and adapters[0].keys() == adapters[1].keys()
    for name, value in adapters[0].items():
        assert torch.equal(value, adapters[1][name]), name


def test_training_from_model_path(checkpoint, tmp_path):
    path, _, _ = checkpoint
    result, records = run_in_process(tmp_path / "run", [f"model.path={path}"])
    assert result["status"] == "completed"
    assert train_records(records)[-1]["train/loss"] < train_records(records)[0]["train/loss"]


@pytest.mark.parametrize(("remove", "message"), [("model.safetensors", "no weights"),
                                                ("tokenizer.json", "no tokenizer"),
                                                ("config.json", "no config.json")])
def test_incomplete_checkpoint_is_refused_before_any_work(checkpoint, remove, message):
    from gradscale.checks import ConfigError
    from gradscale.config import validate

    path, _, _ = checkpoint
    (path / remove).unlink()
    with pytest.raises(ConfigError, match=f"model.path='{path}' .*{message}"):
        validate(compose([f"model.path={path}"]))


def test_seq_len_limit_comes_from_the_checkpoint(checkpoint):
    from gradscale.checks import ConfigError
    from gradscale.config import validate

    path, saved, _ = checkpoint
    config = json.loads((path / "config.json").read_text())
    config["max_position_embeddings"] = 32
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match=r"seq_len=64 .* max_position_embeddings \(32\)"):
        validate(compose([f"model.path={path}", "seq_len=64"]))


def test_bf16_on_the_cpu_runs_attention_in_fp32_and_fp32_runs_keep_sdpa():
    """The attention kernel under bf16 autocast on the CPU is fp32 SDPA (faster there); fp32 runs are as before."""
    from gradscale.hydra_glue import to_object
    from gradscale.job import build_model
    from gradscale.model import FP32_ATTENTION
    from gradscale.parallel import Ranks

    nets = {}
    for precision in ("fp32", "bf16"):
        cfg = to_object(compose(["model.init=random", f"precision={precision}"]))
        nets[precision] = build_model(cfg, torch.device("cpu"), Ranks(world_size=1))
    assert nets["fp32"].config._attn_implementation == "sdpa"
    assert nets["bf16"].config._attn_implementation == FP32_ATTENTION
    inputs = torch.randint(0, nets["fp32"].config.vocab_size, (2, 32))
    with torch.no_grad():
        exact = nets["fp32"](input_ids=inputs).logits
        with torch.autocast("cpu", dtype=torch.bfloat16):
            fast = nets["bf16"](input_ids=inputs).logits
            nets["bf16"].set_attn_implementation("sdpa")  # autocast's own: attention in bf16
            plain = nets["bf16"](input_ids=inputs).logits
    assert fast.dtype == plain.dtype == torch.bfloat16
    # fp32 attention is no further from the fp32 model than bf16 attention is
    assert (fast.float() - exact).abs().max() <= (plain.float() - exact).abs().max() * 1.5
    assert not torch.equal(fast, plain)  # the kernel really changed
