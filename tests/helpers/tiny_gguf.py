"""A tiny Llama written as an fp32 GGUF file with the `gguf` package, as llama.cpp's converter lays it out:
the stand-in for SmolLM2's GGUF file in tests (no network)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

CHAT_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's q/k row order (convert_hf_to_gguf.py), which transformers undoes on load."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_tiny_gguf(path: Path):
    """A tiny Llama with a byte-level BPE tokenizer and a chat template, written to `path`; returns the
    model it was written from and its tokenizer."""
    import gguf
    from tokenizers import AddedToken
    from transformers import LlamaConfig, LlamaForCausalLM

    from gradscale import data

    tokenizer = data.build_tokenizer(data.pydoc_examples(), 512, None)
    tokenizer.add_special_tokens({"additional_special_tokens": [AddedToken("<|im_start|>"), AddedToken("<|im_end|>")]})
    vocab = tokenizer.backend_tokenizer.get_vocab(with_added_tokens=True)
    tokens = sorted(vocab, key=vocab.get)
    merges = tokenizer.backend_tokenizer.to_str()
    merges = [" ".join(m) if isinstance(m, list) else m for m in json.loads(merges)["model"]["merges"]]
    config = LlamaConfig(vocab_size=len(tokens), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=256,
                         rms_norm_eps=1e-5, tie_word_embeddings=True,
                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_context_length(256)
    writer.add_embedding_length(32)
    writer.add_block_count(2)
    writer.add_feed_forward_length(64)
    writer.add_head_count(4)
    writer.add_head_count_kv(2)
    writer.add_rope_dimension_count(8)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(len(tokens))
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    special = {data.BOS, data.EOS, data.PAD, "<|im_start|>", "<|im_end|>"}
    writer.add_token_types([3 if t in special else 1 for t in tokens])
    writer.add_token_merges(merges)
    writer.add_bos_token_id(vocab["<|im_start|>"])
    writer.add_eos_token_id(vocab["<|im_end|>"])
    writer.add_chat_template(CHAT_TEMPLATE)
    state = {k: v.detach().numpy() for k, v in model.state_dict().items()}
    writer.add_tensor("token_embd.weight", state["model.embed_tokens.weight"])
    writer.add_tensor("output_norm.weight", state["model.norm.weight"])
    for i in range(2):
        layer = f"model.layers.{i}."
        names = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm", "attn_v": "self_attn.v_proj",
                 "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
                 "ffn_down": "mlp.down_proj"}
        for ours, theirs in names.items():
            writer.add_tensor(f"blk.{i}.{ours}.weight", state[layer + theirs + ".weight"])
        writer.add_tensor(f"blk.{i}.attn_q.weight", llama_cpp_permute(state[layer + "self_attn.q_proj.weight"], 4))
        writer.add_tensor(f"blk.{i}.attn_k.weight", llama_cpp_permute(state[layer + "self_attn.k_proj.weight"], 2))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return model, tokenizer
