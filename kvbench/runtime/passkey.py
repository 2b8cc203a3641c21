"""Retrieval tasks (`kvbench run STRATEGY --mode passkey --task T --depth D`): Quest Table
1's passkey and RULER-style synthetic tasks, generated in-process.

Every task hides needles among filler sentences and ends with a question; the run decodes
greedily and a row is correct when its first generated tokens are exactly the answer's
tokens. Each batch row draws its own values (seeded by `--seed`, the task and the row), so a
batch of B is B trials at one depth and length. The wording is kvbench's own; the tasks
follow RULER (Hsieh et al., "RULER: What's the Real Context Size of Your Long-Context
Language Models?", COLM 2024, section 3.1: NIAH multi-key and multi-value, variable
tracking):

- `passkey`: one five-digit key at depth D (Quest's passkey test).
- `multikey`: `NEEDLES` needles "the magic number for <word> is <n>" with distinct words at
  even depths, the asked one at depth D; answer: its number (NIAH multi-key).
- `multivalue`: `NEEDLES` numbers for one word at even depths, the first at depth D;
  answer: all of them in prompt order, comma-separated (NIAH multi-value).
- `vartrack`: a chain "VAR A = n.", "VAR B = VAR A.", ... of `HOPS` assignments at even
  depths from D on; answer: every variable that holds n, in order (variable tracking).

The prompt is assembled from separately tokenised pieces (instruction, filler, needles,
question), the filler repeated and cut so that the whole prompt is exactly `--prompt-len`
tokens; needle i starts after depth_i x (filler tokens) of the filler.

Shapes: prompt rows [B, P] int64; answers: one list of token ids per row (rows may tokenise
to different lengths).
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Callable, Iterator
from typing import Any

from kvbench.errors import require
from kvbench.schema import ParamValue, Record, measured, not_measured

TASKS = ("passkey", "multikey", "multivalue", "vartrack")
NEEDLES = 4  # needles of multikey and multivalue
HOPS = 4  # assignments in vartrack's chain

INTRO = ("Below is a long note. Somewhere in it is a secret number. Read it all and "
         "remember the secret number.\n")
FILLER = ("The river runs past the old mill and the birds sing in the morning light. "
          "A farmer walks to the market with a basket of apples. ")
KEY = "The secret number is {key}. Remember it: the secret number is {key}.\n"
QUESTION = "\nWhat is the secret number? The secret number is"

WORDS = ("apple", "river", "candle", "garden", "mirror", "pencil", "window", "forest",
         "button", "silver", "rocket", "castle", "anchor", "violin", "tiger", "meadow")
NAMES = ("QXR", "BZL", "KMT", "FWD", "HJP", "NVC", "TGS", "YLK", "PRM", "DXW")
INTROS = {
    "multikey": "Below is a long note with some special magic numbers hidden in it. "
                "Read it all and remember them.\n",
    "multivalue": "Below is a long note with some special magic numbers hidden in it. "
                  "Read it all and remember them.\n",
    "vartrack": "Below is a long note with variable assignments hidden in it. Read it all "
                "and track the variables.\n",
}


def _number(rng: random.Random) -> str:
    return str(rng.randrange(10000, 100000))


def _even(depth: float, n: int) -> list[float]:
    """n depths from `depth` on, evenly spaced and wrapping around [0, 1)."""
    return [depth] if n == 1 else [(depth + i / n) % 1.0 for i in range(n)]


def task_text(task: str, rng: random.Random, depth: float
              ) -> tuple[str, list[tuple[float, str]], str, str]:
    """(instruction, needles as (depth, text), question, answer) of one row of `task`."""
    if task == "passkey":
        key = _number(rng)
        return INTRO, [(depth, KEY.format(key=key))], QUESTION, " " + key
    if task == "multikey":
        words = rng.sample(WORDS, NEEDLES)
        nums = [_number(rng) for _ in words]
        needles = [(d, f"One of the special magic numbers for {w} is: {n}.\n")
                   for d, w, n in zip(_even(depth, NEEDLES), words, nums, strict=True)]
        question = (f"\nWhat is the special magic number for {words[0]} mentioned in the "
                    f"note? The special magic number for {words[0]} is")
        return INTROS[task], needles, question, " " + nums[0]
    if task == "multivalue":
        word = rng.choice(WORDS)
        nums = [_number(rng) for _ in range(NEEDLES)]
        needles = [(d, f"One of the special magic numbers for {word} is: {n}.\n")
                   for d, n in zip(_even(depth, NEEDLES), nums, strict=True)]
        order = [n for _, n in sorted(zip(_even(depth, NEEDLES), nums, strict=True))]
        question = (f"\nWhat are all the special magic numbers for {word} mentioned in the "
                    f"note? The special magic numbers for {word} are")
        return INTROS[task], needles, question, " " + ", ".join(order)
    require(task == "vartrack", f"--task '{task}': one of {', '.join(TASKS)}")
    names, value = rng.sample(NAMES, HOPS), _number(rng)
    lines = [f"VAR {names[0]} = {value}.\n"] + [
        f"VAR {b} = VAR {a}.\n" for a, b in itertools.pairwise(names)]
    spread = [depth + (1 - depth) * i / HOPS for i in range(HOPS)]  # in chain order
    question = (f"\nFind all variables that are assigned the value {value} in the note. "
                f"Answer: the variables assigned {value} are")
    return INTROS[task], list(zip(spread, lines, strict=True)), question, " " + " ".join(names)


def build(encode: Callable[[str], list[int]], batch: int, prompt_len: int, depth: float,
          seed: int, vocab: int, task: str = "passkey") -> tuple[Any, list[list[int]],
                                                                 list[str]]:
    """(prompt rows [B, P], answer tokens per row, answer texts) for `task`."""
    import torch

    require(task in TASKS, f"--task '{task}': one of {', '.join(TASKS)}")
    filler = encode(FILLER)
    rng = random.Random(f"passkey-{seed}" if task == "passkey" else f"{task}-{seed}")
    rows, answers, texts = [], [], []
    for _ in range(batch):
        intro, needles, question, answer = task_text(task, rng, depth)
        head, tail = encode(intro), encode(question)
        pieces = sorted((d, encode(text)) for d, text in needles)
        room = prompt_len - len(head) - len(tail) - sum(len(p) for _, p in pieces)
        require(room >= 0, f"--prompt-len {prompt_len}: the {task} prompt needs at least "
                f"{prompt_len - room} tokens")
        fill = (filler * (room // len(filler) + 1))[:room]
        body, at = [], 0
        for d, piece in pieces:
            cut = round(d * room)
            body += fill[at:cut] + piece
            at = cut
        rows.append(head + body + fill[at:] + tail)
        answers.append([t % vocab for t in encode(answer)])
        texts.append(answer.strip())
    return torch.tensor(rows, dtype=torch.long) % vocab, answers, texts


def score(tokens: Any, answers: list[list[int]], prompt_len: int) -> list[float]:
    """Per row: 1.0 when the generated tokens [B, >= P + A] start with the row's answer."""
    got = tokens[:, prompt_len:].tolist()
    return [float(g[:len(a)] == a) for g, a in zip(got, answers, strict=True)]


def records(name: str, params: dict[str, ParamValue], tokens: Any,
            answers: list[list[int]], prompt_len: int, accuracy: str) -> Iterator[Record]:
    """`passkey_accuracy`: the share of rows that answered exactly (one sample); the task
    is in params ("task")."""
    if accuracy:  # random weights cannot retrieve anything
        yield not_measured("run", name, "passkey_accuracy", "waived", accuracy, params)
        return
    correct = score(tokens, answers, prompt_len)
    yield measured("run", name, "passkey_accuracy", "ratio", "higher",
                   [sum(correct) / len(correct)], params,
                   {"statistic": "share of batch rows whose first generated tokens are "
                                 "their answer", "rows": len(correct), "correct": correct,
                    "answer_tokens": max(len(a) for a in answers)})
