"""Llama 3.2 model: a checkpoint directory (gradscale/weights.py says which), or a random init built
from the config's dimensions.

The architecture is transformers' LlamaForCausalLM as Llama 3.2 ships it: grouped-query attention,
llama3 RoPE scaling (`rope_parameters`, transformers 5), tied embeddings, RMSNorm, SwiGLU MLP.
Weights are always fp32 master weights; bf16 is autocast in the loop.
"""

from __future__ import annotations

import logging

import torch

log = logging.getLogger(__name__)


def llama_config(model_cfg):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=model_cfg.vocab_size,
        hidden_size=model_cfg.hidden_size,
        intermediate_size=model_cfg.intermediate_size,
        num_hidden_layers=model_cfg.num_hidden_layers,
        num_attention_heads=model_cfg.num_attention_heads,
        num_key_value_heads=model_cfg.num_key_value_heads,
        head_dim=model_cfg.head_dim,
        hidden_act="silu",  # SwiGLU
        max_position_embeddings=model_cfg.max_position_embeddings,
        rms_norm_eps=model_cfg.rms_norm_eps,
        tie_word_embeddings=model_cfg.tie_word_embeddings,
        initializer_range=model_cfg.initializer_range,
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": model_cfg.rope_theta,
            "factor": model_cfg.rope_factor,
            "low_freq_factor": model_cfg.rope_low_freq_factor,
            "high_freq_factor": model_cfg.rope_high_freq_factor,
            "original_max_position_embeddings": model_cfg.rope_original_max_position_embeddings,
        },
        use_cache=False,
    )


def build_model(model_cfg, seed: int, device: torch.device, checkpoint: str | None = None) -> torch.nn.Module:
    """The weights in `checkpoint` (weights.checkpoint_dir), or a random init seeded by `seed` (identical
    across runs) when it is None. Either way the RNG leaves here seeded by `seed`, so the LoRA init and
    dropout that follow never depend on what ran before in the process (a sweep's earlier jobs)."""
    torch.manual_seed(seed)
    if checkpoint:
        model = load_checkpoint(checkpoint)
        torch.manual_seed(seed)
    else:
        from transformers import LlamaForCausalLM

        model = LlamaForCausalLM(llama_config(model_cfg))
    n_params = sum(p.numel() for p in model.parameters())
    log.info("model %s: %.2fM parameters, %s", model_cfg.name, n_params / 1e6, checkpoint or "random init")
    return model.to(device=device, dtype=torch.float32)


FP32_ATTENTION = "gradscale_sdpa_fp32"


def sdpa_in_fp32(module, query, key, value, attention_mask, **kwargs):
    """transformers' SDPA attention with q, k, v upcast to fp32 and the output cast back to their dtype."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    with torch.autocast(query.device.type, enabled=False):  # autocast would cast them down again
        out, weights = sdpa_attention_forward(module, query.float(), key.float(), value.float(), attention_mask,
                                              **kwargs)
    return out.to(query.dtype), weights


def attention_in_fp32(model: torch.nn.Module) -> None:
    """Under bf16 autocast on the CPU, attention runs in fp32: PyTorch's CPU flash-attention kernel is 2.3x
    faster in fp32 than in bf16 at SmolLM2's sizes, its backward above all (docs/performance.md), and fp32
    is the more exact of the two. The weights, matmuls and everything else stay as autocast has them."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(FP32_ATTENTION, sdpa_in_fp32)
    AttentionMaskInterface.register(FP32_ATTENTION, sdpa_mask)  # the masks SDPA takes (causal: none at all)
    model.set_attn_implementation(FP32_ATTENTION)


def apply_finetune(model: torch.nn.Module, finetune_cfg) -> torch.nn.Module:
    """full: the model as it is. lora: the base frozen, peft LoRA adapters on the target modules
    (A random from the seeded RNG, B zero: the adapted model starts equal to the base)."""
    if finetune_cfg.name == "full":
        return model
    from peft import LoraConfig, get_peft_model

    lora = LoraConfig(r=finetune_cfg.rank, lora_alpha=finetune_cfg.alpha, lora_dropout=finetune_cfg.dropout,
                      target_modules=list(finetune_cfg.target_modules), bias="none", task_type="CAUSAL_LM")
    model = get_peft_model(model, lora)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    log.info("LoRA rank %d on %s: %.2fM trainable parameters", finetune_cfg.rank,
             ",".join(finetune_cfg.target_modules), trainable / 1e6)
    return model


def load_checkpoint(path: str) -> torch.nn.Module:
    """Weights from a local checkpoint directory; no network."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # half a second of loading: a bar on stderr would only be noise

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, local_files_only=True)


def load_tokenizer(path: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path, local_files_only=True)
