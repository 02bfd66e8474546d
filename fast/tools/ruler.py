"""RULER-style synthetic retrieval tasks, generated offline with fixed seeds (no downloads).

Part of the package because `kvcert calibrate-page` draws its unlabelled prompts from here;
the benchmark harnesses read it through benchmarks/ruler.py.

Tasks (each a haystack of filler sentences with facts hidden at chosen depths):
    passkey     one 5-digit pass key at a given depth
    needle      one "special magic number for <word>" needle (single key)
    multikey    4 needles with different keys; the question asks for one of them
    multivalue  3 values for the same key; all must be returned
    vartrack    a chain of variable assignments X1 = 12345, X2 = X1, ...; which variables equal the value
                (not in DEFAULT_TASKS: SmolLM2-135M's full cache never answers it, see DEFAULT_TASKS)

An example is {task, seed, depth, haystack, facts, question, answers}; `score(text, answers)` is 1
when every answer string appears in the model's output. `build(tokenizer, ex, target_tokens)` sizes
the haystack to about `target_tokens` tokens and returns (input_ids [1, N], n_tokens);
`allowance(tokenizer, ex)` is the number of new tokens the task's answer needs (task-aware
generation length: the answers joined as the model writes them, plus slack).

Haystacks: "synthetic" (8 filler sentences drawn at random, the classic RULER/needle filler) or
"natural": consecutive prose sentences of the Python language reference that ships with the
interpreter (`pydoc_data.topics`, part of every CPython installation; read from disk, never
downloaded), filtered to sentences without digits or code, starting at a seed-dependent offset.
"""

import hashlib
import random
import re

WORDS = ("apple river stone cloud maple tiger lemon violet copper harbor falcon meadow orbit pepper "
         "silver thunder willow amber canyon ember frost garnet hazel island jasper lotus marble "
         "nectar onyx pearl quartz raven saffron topaz umber velvet").split()
FILLER = [
    "The grass is green and the sky is blue.",
    "The sun rises in the east and sets in the west.",
    "A quiet afternoon passed slowly in the small town.",
    "Birds sang in the trees while the wind moved the leaves.",
    "The river kept flowing past the old stone bridge.",
    "People walked along the market street looking at the stalls.",
    "Clouds gathered over the hills before the evening rain.",
    "The library was warm and smelled of old paper.",
]
TASKS = ("passkey", "needle", "multikey", "multivalue", "vartrack")
# The tasks the harnesses run by default: those SmolLM2-135M's full cache answers within their
# allowance (tests/test_evict_eval.py checks each). vartrack stays available (--tasks) but is out:
# the full cache answered it 0 of 20 times at 384 tokens (results/evict_eval.json of 2026-12-03),
# and in an ad-hoc trial (not kept) a two-chain variant asking one variable's value (a 1-in-2 guess)
# was right 8 of 20 times.
DEFAULT_TASKS = ("passkey", "needle", "multikey", "multivalue")
HAYSTACKS = ("synthetic", "natural")
ANSWER_SLACK = 6          # tokens beyond the answers themselves (separators, "and", a period)
_NATURAL = []


def natural_sentences():
    """Prose sentences of pydoc_data.topics (the language reference shipped with CPython), in order:
    8-40 words, letters and plain punctuation only (no digits, no code). Cached."""
    if not _NATURAL:
        import pydoc_data.topics as topics
        text = " ".join(topics.topics[k] for k in sorted(topics.topics))
        text = re.sub(r"\s+", " ", text)
        for sent in re.split(r"(?<=[.!?]) (?=[A-Z])", text):
            words = sent.split()
            if 8 <= len(words) <= 40 and re.fullmatch(r"[A-Za-z ,;:'\"().!?-]+", sent) and sent[-1] in ".!?":
                _NATURAL.append(sent)
    return _NATURAL


def natural_source():
    """Where the natural haystack comes from (for results files): module, sentences, sha256."""
    import pydoc_data.topics as topics
    sents = natural_sentences()
    return {"module": "pydoc_data.topics", "file": topics.__file__, "sentences": len(sents),
            "sha256": hashlib.sha256("\n".join(sents).encode()).hexdigest()}


def allowance(tokenizer, ex):
    """New tokens the task needs: its answers written as a list (", " between them), plus slack."""
    return len(tokenizer(" " + ", ".join(ex["answers"]) + ".")["input_ids"]) + ANSWER_SLACK


def _num(rng):
    return str(rng.randint(10000, 99999))


def make_example(task, seed, depth, haystack="synthetic"):
    """depth in [0, 1]: where the (first) fact sits in the haystack."""
    if haystack not in HAYSTACKS:
        raise ValueError(f"unknown haystack {haystack!r}; choose from {', '.join(HAYSTACKS)}")
    rng = random.Random(f"{task}-{seed}")
    if task == "passkey":
        key = _num(rng)
        facts = [f"The pass key is {key}. Remember it. {key} is the pass key."]
        question = "What is the pass key? The pass key is"
        answers = [key]
    elif task == "needle":
        word, val = rng.choice(WORDS), _num(rng)
        facts = [f"One of the special magic numbers for {word} is: {val}."]
        question = f"What is the special magic number for {word}? The special magic number for {word} is"
        answers = [val]
    elif task == "multikey":
        words = rng.sample(WORDS, 4)
        vals = [_num(rng) for _ in words]
        facts = [f"One of the special magic numbers for {w} is: {v}." for w, v in zip(words, vals)]
        pick = rng.randrange(4)
        question = f"What is the special magic number for {words[pick]}? The special magic number for {words[pick]} is"
        answers = [vals[pick]]
    elif task == "multivalue":
        word = rng.choice(WORDS)
        vals = [_num(rng) for _ in range(3)]
        facts = [f"One of the special magic numbers for {word} is: {v}." for v in vals]
        question = f"What are all the special magic numbers for {word}? The special magic numbers for {word} are"
        answers = vals
    elif task == "vartrack":
        val = _num(rng)
        names = [f"V{rng.randint(100, 999)}" for _ in range(3)]
        facts = [f"VAR {names[0]} = {val}."] + [f"VAR {names[i]} = VAR {names[i - 1]}." for i in range(1, 3)]
        question = f"Which variables are assigned the value {val}? The variables assigned the value {val} are"
        answers = names
    else:
        raise ValueError(f"unknown task {task!r}; choose from {', '.join(TASKS)}")
    return {"task": task, "seed": seed, "depth": depth, "haystack": haystack, "facts": facts, "question": question,
            "answers": answers}


def _haystack(ex, n_sentences):
    rng = random.Random(f"hay-{ex['task']}-{ex['seed']}")
    if ex.get("haystack", "synthetic") == "natural":
        src = natural_sentences()
        start = rng.randrange(len(src))
        hay = [src[(start + i) % len(src)] for i in range(n_sentences)]   # consecutive prose
    else:
        hay = [rng.choice(FILLER) for _ in range(n_sentences)]
    # the first fact at `depth`, the others spread after it (in order)
    start = int(ex["depth"] * n_sentences)
    spots = sorted({min(n_sentences, start + i * max(1, (n_sentences - start) // (len(ex["facts"]) + 1)))
                    for i in range(len(ex["facts"]))})
    while len(spots) < len(ex["facts"]):
        spots.append(spots[-1])
    for spot, fact in sorted(zip(spots, ex["facts"]), reverse=True):
        hay.insert(spot, fact)
    return " ".join(hay)


def split_question(ex):
    """('What is the pass key?', 'The pass key is'): the question and the answer's prefix."""
    q, _, prefix = ex["question"].partition("? ")
    return q + "?", prefix


def prompt_text(ex, n_sentences):
    return ("There is important information hidden in the following text. Find it and memorize it.\n\n"
            + _haystack(ex, n_sentences) + "\n\n" + split_question(ex)[0])


def build(tokenizer, ex, target_tokens):
    """input_ids [1, N] of at most target_tokens tokens: the chat template with the haystack and
    the question as the user turn, and the assistant turn opened with the answer's prefix."""
    import torch

    question, prefix = split_question(ex)
    tail = torch.tensor([tokenizer(prefix)["input_ids"]])

    def encode(n):
        msgs = [{"role": "user", "content": prompt_text(ex, n)}]
        ids = tokenizer.apply_chat_template(msgs, add_generation_prompt=True, return_tensors="pt", return_dict=False)
        ids = ids if torch.is_tensor(ids) else torch.tensor([ids])
        return torch.cat([ids, tail], 1)

    sample = natural_sentences()[:200] if ex.get("haystack") == "natural" else FILLER
    per = len(tokenizer(" ".join(sample))["input_ids"]) / len(sample)
    n = max(1, int(target_tokens / per))
    ids = encode(n)
    while ids.shape[1] > target_tokens and n > 1:              # trim to fit
        n = max(1, int(n * target_tokens / ids.shape[1]) - 1)
        ids = encode(n)
    return ids, ids.shape[1]


def score(text, answers):
    return int(all(a in text for a in answers))


def examples(n, *, tasks=DEFAULT_TASKS, seed0=0, haystacks=("synthetic",), cycle=TASKS):
    """n examples of `tasks`, fixed seeds: input i of the sequence has task cycle[i % len(cycle)]
    (inputs of tasks not asked for are skipped, so a subset of the tasks gets exactly the inputs
    the whole cycle gives for them), haystack haystacks[(i // len(cycle)) % len(haystacks)], and a
    depth spread over the whole range: a stratified draw in [0.05, 0.95] (input i in stratum
    4i mod 9, jittered within it). cycle=tasks gives every index to the tasks asked for."""
    unknown = [t for t in tasks if t not in cycle]
    if unknown:
        raise ValueError(f"unknown task {unknown[0]!r}; choose from {', '.join(cycle)}")
    out, i = [], 0
    while len(out) < n:
        task = cycle[i % len(cycle)]
        if task in tasks:
            rng = random.Random(f"depth-{seed0 + i}")
            stratum = (i * 4) % 9                                   # 0, 4, 8, 3, 7, 2, 6, 1, 5, ...: spread early
            depth = round(0.05 + 0.1 * stratum + 0.1 * rng.random(), 3)
            hay = haystacks[(i // len(cycle)) % len(haystacks)]
            out.append(make_example(task, seed0 + i, min(depth, 0.95), hay))
        i += 1
    return out
