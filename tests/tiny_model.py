"""A random tiny Llama with GQA (4 query heads, 2 KV heads, head dim 32) for fast tests."""

import torch
from transformers import LlamaConfig, LlamaForCausalLM


def tiny_llama(seed=0, layers=2, attn="sdpa"):
    config = LlamaConfig(vocab_size=128, hidden_size=128, intermediate_size=256, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=512,
                         rope_theta=10000.0, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                         tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    with torch.no_grad():  # larger weights than the default init: peaked attention, visible errors
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(4.0)
            layer.self_attn.k_proj.weight.mul_(4.0)
    model.set_attn_implementation(attn)
    return model.eval()


def tiny_ids(B=1, N=40, seed=1, vocab=128):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (B, N), generator=g)


def tiny_evict_llama(hidden=64):
    """3 layers, 4 query heads, 2 KV heads, default init, 2048 positions: the eviction tests' model."""
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=128, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=3,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                      attn_implementation="sdpa")
    return LlamaForCausalLM(cfg).eval()
