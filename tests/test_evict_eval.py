"""The evaluation harness's inputs (benchmarks/ruler.py): every task's answer fits its generation
allowance, the natural haystack is prose from an installed package, depths cover the range, and
the full cache answers each task at its allowance on SmolLM2 (a few inputs per task)."""
import pytest

from benchmarks.ruler import (ANSWER_SLACK, TASKS, allowance, build, examples, make_example, natural_sentences,
                              natural_source, score)


@pytest.fixture(scope="module")
def smollm2():
    from fast.integrations.model import load_smollm2
    return load_smollm2()


def test_allowance_fits_every_answer_and_is_needed(smollm2):
    """property: the answers written as the model writes them (a list) fit in the allowance, so
    scoring can succeed; cut to the answer's own length minus one token, it no longer can."""
    _, tok = smollm2
    for task in TASKS:
        for seed in range(3):
            ex = make_example(task, seed, 0.5)
            written = tok(" " + ", ".join(ex["answers"]) + ".")["input_ids"]
            n = allowance(tok, ex)
            assert n == len(written) + ANSWER_SLACK
            assert score(tok.decode(written[:n]), ex["answers"]) == 1
            assert score(tok.decode(written[:len(written) - 2]), ex["answers"]) == 0
    assert allowance(tok, make_example("multivalue", 0, 0.5)) > 19 > allowance(tok, make_example("passkey", 0, 0.5))


def test_natural_haystack_is_installed_prose_and_depths_spread(smollm2):
    """property: the natural haystack is read from pydoc_data (no download), has no digits (no
    decoy numbers), and the prompt holds the facts; depths of 45 inputs cover [0.05, 0.95]."""
    _, tok = smollm2
    src = natural_source()
    assert src["module"] == "pydoc_data.topics" and src["sentences"] > 500
    assert not any(c.isdigit() for s in natural_sentences() for c in s)
    ex = make_example("needle", 3, 0.4, "natural")
    ids, n = build(tok, ex, 400)
    text = tok.decode(ids[0])
    assert n <= 400 and ex["facts"][0] in text and natural_sentences()[0][:0] == ""
    depths = sorted(e["depth"] for e in examples(45, haystacks=("synthetic", "natural")))
    assert depths[0] < 0.15 and depths[-1] > 0.85
    assert {e["haystack"] for e in examples(10, haystacks=("synthetic", "natural"))} == {"synthetic", "natural"}
    with pytest.raises(ValueError):
        make_example("needle", 0, 0.5, "web")


# every task the harnesses run by default (ruler.DEFAULT_TASKS) and the prompt length at which the
# full cache answers its first synthetic harness input (examples(10, both haystacks)); vartrack is
# out of the defaults because SmolLM2-135M never answers it.
ANSWERED = {"passkey": 384, "needle": 384, "multikey": 384, "multivalue": 320}


def test_default_tasks_are_the_answered_ones():
    from benchmarks.ruler import DEFAULT_TASKS, TASKS
    assert set(ANSWERED) == set(DEFAULT_TASKS) and "vartrack" in TASKS and "vartrack" not in DEFAULT_TASKS


def test_task_subset_gets_the_inputs_of_the_whole_cycle(tmp_path):
    """examples(tasks=subset) are exactly the whole cycle's inputs of those tasks, in order, so a
    subset run can carry an earlier run's records (ruler.carried); other settings are refused."""
    import json
    from benchmarks.ruler import DEFAULT_TASKS, TASKS, carried
    both = ("synthetic", "natural")
    whole = examples(25, tasks=TASKS, haystacks=both)
    sub = examples(20, haystacks=both)
    assert sub == [e for e in whole if e["task"] != "vartrack"] and len({e["seed"] for e in sub}) == 20
    assert examples(5, tasks=("needle",), cycle=("needle",))[4]["seed"] == 4
    with pytest.raises(ValueError, match="unknown task"):
        examples(3, tasks=("sudoku",))
    recs = [dict(task=e["task"], seed=e["seed"], depth=e["depth"], haystack=e["haystack"], full=1) for e in whole[:12]]
    src = tmp_path / "old.json"
    src.write_text(json.dumps({"command": "x", "seconds": 1.0, "settings": {"tokens": 384, "tasks": list(TASKS)},
                               "records": recs}))
    got, prov = carried(src, {"tokens": 384, "tasks": list(DEFAULT_TASKS)}, ("tokens", "tasks"), sub)
    assert [r["seed"] for r in got] == [e["seed"] for e in sub[:len(got)]] and len(got) == 10 and prov["records"] == 10
    with pytest.raises(ValueError, match="other settings"):
        carried(src, {"tokens": 512}, ("tokens",), sub)


@pytest.mark.parametrize("task,tokens", sorted(ANSWERED.items()))
def test_full_cache_answers_each_task_at_its_allowance(smollm2, task, tokens):
    """property, on SmolLM2: for each task the full cache answers a harness input within that
    task's allowance (greedy, stop at end-of-turn), and not within half of it for the
    multi-answer task: a harm is never a length artifact, and the allowance is what makes
    multivalue answerable (the old harness's 10 tokens could not)."""
    import torch
    model, tok = smollm2
    ex = next(e for e in examples(10, haystacks=("synthetic", "natural")) if e["task"] == task and e["haystack"] == "synthetic")
    ids, _ = build(tok, ex, tokens)
    eos = tok.convert_tokens_to_ids("<|im_end|>")

    def answer(n):
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                                 eos_token_id=eos, pad_token_id=eos)
        return score(tok.decode(out[0, ids.shape[1]:]), ex["answers"])
    assert answer(allowance(tok, ex)) == 1
    if task == "multivalue":
        assert answer(10) == 0


def test_resume_keeps_records_and_refuses_other_settings(tmp_path):
    """--resume (evict_eval, quant_eval): an interrupted run's records and seconds come back when the
    settings agree; a file run with other settings is refused (its inputs would not be these)."""
    import json

    from benchmarks.ruler import resumed
    out = tmp_path / "run.json"
    assert resumed(out, {"n": 4}, ("n",)) == ([], 0.0)
    out.write_text(json.dumps({"settings": {"n": 4, "tokens": 384, "done": 2}, "seconds": 12.5,
                               "records": [{"full": 1}, {"full": 0}]}))
    assert resumed(out, {"n": 4, "tokens": 384}, ("n", "tokens")) == ([{"full": 1}, {"full": 0}], 12.5)
    with pytest.raises(ValueError, match="tokens"):
        resumed(out, {"n": 4, "tokens": 512}, ("n", "tokens"))
