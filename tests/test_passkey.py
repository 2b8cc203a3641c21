"""Passkey mode: the prompt's length and key position, scoring, the CLI's records and bad
input."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest
import torch
from conftest import assert_usage_error, cli

from kvbench.cli import main
from kvbench.runtime import passkey


def encode(text: str) -> list[int]:
    return list(text.encode("utf-8"))


@pytest.mark.parametrize("depth", [0.0, 0.25, 0.9, 1.0])
def test_prompt_is_exact_length_with_the_key_at_depth(depth: float) -> None:
    rows, answers, keys = passkey.build(encode, 3, 700, depth, seed=7, vocab=256)
    assert rows.shape == (3, 700) and len(set(keys)) == 3
    for r, key in enumerate(keys):
        text = bytes(rows[r].tolist()).decode()
        assert text.startswith(passkey.INTRO) and text.endswith(passkey.QUESTION)
        at = text.index(f"is {key}.")
        body = len(text) - len(passkey.INTRO) - len(passkey.QUESTION)
        line = len(passkey.KEY.format(key=key))
        room = body - line
        assert abs((at - len(passkey.INTRO) - len("The secret number ")) - depth * room) <= 1
        assert bytes(answers[r]).decode() == " " + key
    assert passkey.build(encode, 3, 700, depth, seed=7, vocab=256)[2] == keys  # seeded


def test_passkey_keys_are_those_of_earlier_runs() -> None:
    """The keys of seed 7 as drawn before the RULER tasks were added (results comparable)."""
    import random

    rng = random.Random("passkey-7")
    assert passkey.build(encode, 3, 700, 0.5, seed=7, vocab=256)[2] == [
        str(rng.randrange(10000, 100000)) for _ in range(3)]


@pytest.mark.parametrize("depth", [0.0, 0.3, 0.75])
def test_multikey_hides_distinct_words_at_even_depths_and_asks_the_one_at_depth(
        depth: float) -> None:
    rows, answers, texts = passkey.build(encode, 2, 2000, depth, seed=3, vocab=256,
                                         task="multikey")
    assert rows.shape == (2, 2000)
    for r in range(2):
        text = bytes(rows[r].tolist()).decode()
        found = [(text.index(f"for {w} is: "), w) for w in passkey.WORDS
                 if f"for {w} is: " in text]
        assert len(found) == passkey.NEEDLES
        asked = text.rsplit("magic number for ", 1)[1].split(" ")[0]
        at, word = next((a, w) for a, w in found if w == asked)
        number = text[at + len(f"for {word} is: "):][:5]
        assert texts[r] == number and bytes(answers[r]).decode() == " " + number
        room = 2000 - len(passkey.INTROS["multikey"]) - len(text.split("\n")[-1]) - 1
        room -= sum(len(f"One of the special magic numbers for {w} is: 00000.\n")
                    for _, w in found)
        # the asked needle sits at depth x filler, the others at depth + i/4 (mod 1)
        before = sum(len(f"One of the special magic numbers for {w} is: 00000.\n")
                     for a, w in found if a < at)
        start = at - len("One of the special magic numbers ") - len(passkey.INTROS["multikey"])
        assert abs(start - before - depth * room) <= 1, (start, before, depth * room)


def test_multivalue_answers_every_number_in_prompt_order() -> None:
    rows, answers, texts = passkey.build(encode, 3, 1500, 0.6, seed=1, vocab=256,
                                         task="multivalue")
    for r in range(3):
        text = bytes(rows[r].tolist()).decode()
        word = text.rsplit("magic numbers for ", 1)[1].split(" ")[0]
        parts = text.split(f"numbers for {word} is: ")[1:]
        nums = [p[:5] for p in parts]
        assert len(nums) == passkey.NEEDLES and texts[r] == ", ".join(nums)
        assert bytes(answers[r]).decode() == " " + ", ".join(nums)


def test_vartrack_chain_in_order_after_depth() -> None:
    rows, _answers, texts = passkey.build(encode, 2, 1200, 0.2, seed=5, vocab=256,
                                         task="vartrack")
    for r in range(2):
        text = bytes(rows[r].tolist()).decode()
        names = texts[r].split(" ")
        value = text.split(f"VAR {names[0]} = ")[1][:5]
        assert value.isdigit() and f"the value {value}" in text
        pos = [text.index(f"VAR {names[0]} = {value}.")] + [
            text.index(f"VAR {b} = VAR {a}.") for a, b in itertools.pairwise(names)]
        assert pos == sorted(pos) and len(names) == passkey.HOPS
        assert pos[0] >= len(passkey.INTROS["vartrack"]) + 0.2 * 900


def test_every_task_is_exact_length_seeded_and_refuses_short_prompts() -> None:
    from kvbench.errors import KvbenchError

    for task in passkey.TASKS:
        rows, answers, texts = passkey.build(encode, 2, 900, 0.5, seed=11, vocab=256,
                                             task=task)
        assert rows.shape == (2, 900) and len(answers) == 2
        assert passkey.build(encode, 2, 900, 0.5, seed=11, vocab=256, task=task)[2] == texts
        assert passkey.build(encode, 2, 900, 0.5, seed=12, vocab=256, task=task)[2] != texts
        with pytest.raises(KvbenchError, match=f"the {task} prompt needs at least"):
            passkey.build(encode, 1, 100, 0.5, seed=11, vocab=256, task=task)
    with pytest.raises(KvbenchError, match="--task 'nope': one of passkey, multikey"):
        passkey.build(encode, 1, 900, 0.5, seed=11, vocab=256, task="nope")


def test_score_compares_the_first_generated_tokens_per_row() -> None:
    answers = [[1, 2], [3, 4, 6]]
    tokens = torch.tensor([[9, 9, 1, 2, 5], [9, 9, 3, 4, 6]])
    assert passkey.score(tokens, answers, 2) == [1.0, 1.0]
    tokens[1, 4] = 7
    tokens[0, 3] = 0
    assert passkey.score(tokens, answers, 2) == [0.0, 0.0]


def test_cli_records_and_bad_input(tmp_path: Path, capsys) -> None:
    out = tmp_path / "pk.jsonl"
    base = ["run", "streaming", "--model", "smollm2-135m", "--weights", "random",
            "--layers", "2", "--mode", "passkey", "--prompt-len", "300", "--gen-len", "6"]
    with pytest.raises(SystemExit) as e:
        main([*base, "--depth", "0.3", "--out", str(out)])
    assert e.value.code == 0
    capsys.readouterr()
    recs = [json.loads(line) for line in out.read_text().splitlines()]
    pk = [r for r in recs if r.get("metric") == "passkey_accuracy"]
    assert len(pk) == 1 and pk[0]["status"] == "waived"  # random weights retrieve nothing
    assert pk[0]["params"]["depth"] == 0.3 and pk[0]["params"]["mode"] == "passkey"
    assert "task" not in pk[0]["params"]  # passkey's records keep their keys
    out2 = tmp_path / "mk.jsonl"
    with pytest.raises(SystemExit) as e:
        main([*base[:-3], "500", "--gen-len", "30", "--task", "multikey", "--out", str(out2)])
    assert e.value.code == 0
    capsys.readouterr()
    mk = [json.loads(line) for line in out2.read_text().splitlines()]
    assert {r["params"].get("task") for r in mk if r["kind"] == "run"} == {"multikey"}
    for args, message in ((["--depth", "1.5"], "--depth 1.5: must be in [0, 1]"),
                          (["--prompt-len", "20"], "the passkey prompt needs at least"),
                          (["--turns", "2"], "--mode passkey is single-turn"),
                          (["--task", "nope"], "--task 'nope': one of passkey, multikey"),
                          (["--task", "multivalue", "--prompt-len", "600"],
                           "the multivalue answers take up to"),
                          (["--mode", "eval", "--task", "vartrack"],
                           "--task vartrack is a retrieval task: pass --mode passkey")):
        assert_usage_error(cli([*base, *args, "--out", str(tmp_path / "bad.jsonl")], capsys),
                           message)
    assert not (tmp_path / "bad.jsonl").exists()
