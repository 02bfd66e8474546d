"""`kvcert run --model DIR`: any local Hugging Face Llama-family folder (tiny random Llama, Mistral
and Qwen2 models saved to a temp folder), and one line, exit 2, for a folder that is not a model."""

import json

import pytest

from fast.tools.cli import main
from tiny_model import save_tiny_model


@pytest.fixture
def prompt(tmp_path):
    f = tmp_path / "prompt.txt"
    f.write_text("The grass is green. The sky is blue. " * 3 + "What colour is the sky?")
    return f


@pytest.mark.parametrize("kind", ["llama", "mistral", "qwen2"])
def test_run_with_a_local_model_folder(tmp_path, prompt, capsys, kind):
    model = save_tiny_model(tmp_path / kind, kind)
    out = tmp_path / "run"
    rc = main(["run", "--model", str(model), "--scheme", "int8", "--gate", "certified:0.2", "--prompt-file", str(prompt),
               "--sinks", "0", "--window", "4", "--max-new-tokens", "4", "--out", str(out)])
    text = capsys.readouterr().out
    assert rc == 0 and "coverage" in text
    doc = json.loads((out / "trace.json").read_text())
    assert doc["model"] == str(model)
    # the tiny model's shape, not SmolLM2's: (new tokens - 1) steps x 2 layers x 4 query heads
    assert doc["summary"]["checks"] == (doc["new_tokens"] - 1) * 2 * 4 > 0
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(model)   # no chat template: the prompt is encoded as it is
    assert doc["prompt_tokens"] == len(tok(prompt.read_text())["input_ids"]) > 20


def _one_line(capsys, argv):
    rc = main(argv)
    err = capsys.readouterr().err.strip()
    assert rc == 2 and err.startswith("kvcert: error: --model ") and "\n" not in err and "Traceback" not in err, err
    return err


def test_a_folder_that_is_not_a_model_is_one_line(tmp_path, prompt, capsys):
    base = ["run", "--prompt-file", str(prompt), "--out", str(tmp_path / "out"), "--model"]
    assert "not a directory" in _one_line(capsys, base + [str(tmp_path / "missing")])
    empty = tmp_path / "empty"
    empty.mkdir()
    assert "no config.json" in _one_line(capsys, base + [str(empty)])
    (empty / "config.json").write_text("{not json")
    (empty / "model.safetensors").write_bytes(b"")
    assert "cannot read config.json" in _one_line(capsys, base + [str(empty)])
    (empty / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    assert "'gpt2' is not supported" in _one_line(capsys, base + [str(empty)])
    weights = save_tiny_model(tmp_path / "noweights")
    (weights / "model.safetensors").unlink()
    assert "no *.safetensors" in _one_line(capsys, base + [str(weights)])
    broken = save_tiny_model(tmp_path / "broken")
    (broken / "model.safetensors").write_bytes(b"\0" * 64)   # weights present but corrupt: fails at load
    assert "cannot load the model" in _one_line(capsys, base + [str(broken)])
    assert not (tmp_path / "out").exists()
