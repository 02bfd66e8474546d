"""benchmarks/evict_vs_kvpress.py, the parts that do not need kvpress: the budget it hands kvpress,
the context/question split of the inputs, the kvcert specs, and the paired summary."""
import pytest

from benchmarks.evict_vs_kvpress import KVPRESS_LIKE, kvpress_ratio, question_start, summarize
from benchmarks.ruler import build, examples, split_question
from fast.policies.evictors import make_evictor


def test_ratio_keeps_exactly_the_budget():
    """property: kvpress keeps max(1, int(len * (1 - ratio))) context tokens (its compute_n_kept,
    as documented); the ratio we hand it keeps exactly K, for every K < len."""
    for n in range(70, 420, 7):
        for K in range(1, n):
            assert max(1, int(n * (1 - kvpress_ratio(K, n)))) == K
    with pytest.raises(ValueError):
        kvpress_ratio(300, 300)


def test_question_split_matches_kvpress_preprocess():
    """differential: the context ids end where kvpress's preprocess cuts the chat template (the
    user content without the question) and the rest is question + end of turn + assistant header +
    answer prefix, for each task and haystack."""
    from fast.integrations.model import load_smollm2
    _, tok = load_smollm2()
    for ex in examples(8, haystacks=("synthetic", "natural")):
        ids, _ = build(tok, ex, 384)
        s = question_start(tok, ids, ex)
        q, prefix = split_question(ex)
        assert tok.decode(ids[0, s:]) == "\n\n" + q + "<|im_end|>\n<|im_start|>assistant\n" + prefix
        ctx = tok.decode(ids[0, :s])
        assert ctx.startswith("<|im_start|>") and ctx.endswith(".") and q not in ctx


def test_kvcert_specs_follow_kvpress_conventions():
    """property: SnapKV keeps its 64-query window, TOVA averages all heads and keeps the last token,
    StreamingLLM keeps 4 sinks, KNorm and Random force nothing."""
    got = {m: make_evictor(spec.format(K=100)) for m, spec in KVPRESS_LIKE.items()}
    assert (got["snapkv"].sinks, got["snapkv"].window) == (0, 64)
    assert (got["tova"].heads, got["tova"].sinks, got["tova"].window) == ("all", 0, 1)
    assert (got["streaming"].sinks, got["knorm"].window, got["random"].sinks, got["random"].window) == (4, 0, 0, 0)


def test_summary_pairs_inputs():
    """property: the McNemar counts are per input (kvcert right and kvpress wrong, and the reverse)."""
    inputs = [{"answers": ["111"]}, {"answers": ["222"]}, {"answers": ["333"]}]
    kvp = [{"full": "111", "snapkv@9": "111"}, {"full": "222", "snapkv@9": "0"}, {"full": "333", "snapkv@9": "0"}]
    kvc = {"context": [{"full": "111", "snapkv@9": "0"}, {"full": "222", "snapkv@9": "222"},
                       {"full": "333", "snapkv@9": "333"}]}
    cells = summarize(inputs, kvp, kvc, ["snapkv"], [9])
    mc = cells["snapkv@9"]["kvcert_context"]["mcnemar_vs_kvpress"]
    assert (mc["kvcert_only"], mc["kvpress_only"]) == (2, 1)
    assert cells["snapkv@9"]["kvpress"]["correct"] == 1 and cells["full"]["kvcert_context"]["same_answer_text"] == 3
