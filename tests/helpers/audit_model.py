"""A model of the user's own for the audit's --model: a transformers GPT-2, smaller than the suite's Llama."""


def tiny_gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    return GPT2LMHeadModel(GPT2Config(vocab_size=97, n_positions=32, n_embd=32, n_layer=2, n_head=2, bos_token_id=0,
                                      eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))


def with_dropout():
    from transformers import GPT2Config, GPT2LMHeadModel

    return GPT2LMHeadModel(GPT2Config(vocab_size=97, n_positions=32, n_embd=32, n_layer=2, n_head=2, bos_token_id=0,
                                      eos_token_id=0))


def no_vocabulary():
    import torch

    return torch.nn.Linear(3, 3)
