"""Passkey retrieval (`kvbench run STRATEGY --mode passkey --depth D`): Quest Table 1's task.

A five-digit key sits at a controlled depth of a prompt of filler sentences; the prompt ends
by asking for the key, and the run decodes greedily. A row is correct when its first
generated tokens are exactly the key's tokens. Each batch row gets its own key (seeded by
`--seed` and the row), so a batch of B is B trials at one depth and length.

The prompt is assembled from separately tokenised pieces (instruction, filler, key line,
question), filler repeated and cut so the whole prompt is exactly `--prompt-len` tokens;
the key line starts after depth x (filler tokens) of the filler. The wording is kvbench's
own; the layout follows the passkey tests of the long-context literature.

Shapes: prompt rows [B, P] int64; answers [B, A] (A = tokens of " " + key).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from typing import Any

from kvbench.errors import require
from kvbench.schema import ParamValue, Record, measured, not_measured

INTRO = ("Below is a long note. Somewhere in it is a secret number. Read it all and "
         "remember the secret number.\n")
FILLER = ("The river runs past the old mill and the birds sing in the morning light. "
          "A farmer walks to the market with a basket of apples. ")
KEY = "The secret number is {key}. Remember it: the secret number is {key}.\n"
QUESTION = "\nWhat is the secret number? The secret number is"


def keys(batch: int, seed: int) -> list[str]:
    """One five-digit key per row, reproducible from the run's seed."""
    rng = random.Random(f"passkey-{seed}")
    return [str(rng.randrange(10000, 100000)) for _ in range(batch)]


def build(encode: Callable[[str], list[int]], batch: int, prompt_len: int, depth: float,
          seed: int, vocab: int) -> tuple[Any, Any, list[str]]:
    """(prompt rows [B, P], answer tokens [B, A], keys) for the passkey task."""
    import torch

    intro, question, filler = encode(INTRO), encode(QUESTION), encode(FILLER)
    rows, answers, ks = [], [], keys(batch, seed)
    for key in ks:
        line = encode(KEY.format(key=key))
        room = prompt_len - len(intro) - len(line) - len(question)
        require(room >= 0, f"--prompt-len {prompt_len}: the passkey prompt needs at least "
                f"{prompt_len - room} tokens")
        fill = (filler * (room // len(filler) + 1))[:room]
        cut = round(depth * room)
        rows.append(intro + fill[:cut] + line + fill[cut:] + question)
        answers.append(encode(" " + key))
    t = torch.tensor(rows, dtype=torch.long) % vocab
    return t, torch.tensor(answers, dtype=torch.long) % vocab, ks


def score(tokens: Any, answers: Any, prompt_len: int) -> list[float]:
    """Per row: 1.0 when the generated tokens [B, >= P + A] start with the answer [B, A]."""
    a = answers.shape[1]
    got = tokens[:, prompt_len:prompt_len + a].to(answers.device)
    return (got == answers).all(dim=1).float().tolist()


def records(name: str, params: dict[str, ParamValue], tokens: Any, answers: Any,
            prompt_len: int, accuracy: str) -> Iterator[Record]:
    """`passkey_accuracy`: the share of rows that repeated their key (one sample)."""
    if accuracy:  # random weights cannot retrieve anything
        yield not_measured("run", name, "passkey_accuracy", "waived", accuracy, params)
        return
    correct = score(tokens, answers, prompt_len)
    yield measured("run", name, "passkey_accuracy", "ratio", "higher",
                   [sum(correct) / len(correct)], params,
                   {"statistic": "share of batch rows whose first generated tokens are "
                                 "their key", "rows": len(correct), "correct": correct,
                    "answer_tokens": int(answers.shape[1])})
