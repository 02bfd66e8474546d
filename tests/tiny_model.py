"""A random tiny Llama with GQA (4 query heads, 2 KV heads, head dim 32) for fast tests."""

import torch
from transformers import LlamaConfig, LlamaForCausalLM


def tiny_llama(seed=0, layers=2, attn="sdpa", kv_heads=2):
    config = LlamaConfig(vocab_size=128, hidden_size=128, intermediate_size=256, num_hidden_layers=layers,
                         num_attention_heads=2 * kv_heads, num_key_value_heads=kv_heads, head_dim=32, max_position_embeddings=512,
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


def tiny_tokenizer(vocab=128):
    """A character-level fast tokenizer over printable ASCII (ids < vocab; 0 pad, 1 bos, 2 eos, 3 unk),
    no chat template: what a base model's folder holds."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    chars = [chr(c) for c in range(32, 127)][: vocab - 4]
    table = {"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 3, **{c: i + 4 for i, c in enumerate(chars)}}
    tk = Tokenizer(models.WordLevel(table, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tk.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tk, pad_token="<pad>", bos_token="<s>", eos_token="</s>",
                                   unk_token="<unk>")


def save_tiny_model(path, kind="llama", seed=0):
    """A random tiny model of the Llama family (kind: llama | mistral | qwen2; 2 layers, 4 query heads,
    2 KV heads, head dim 32, vocab 128) saved as a Hugging Face folder: config.json, safetensors, tokenizer."""
    from transformers import AutoConfig, AutoModelForCausalLM
    config = AutoConfig.for_model(kind, vocab_size=128, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=512,
                                  pad_token_id=0, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    model.save_pretrained(path)
    tiny_tokenizer().save_pretrained(path)
    return path
