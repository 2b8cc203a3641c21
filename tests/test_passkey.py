"""Passkey mode: the prompt's length and key position, scoring, the CLI's records and bad
input."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

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
        assert bytes(answers[r].tolist()).decode() == " " + key
    assert passkey.build(encode, 3, 700, depth, seed=7, vocab=256)[2] == keys  # seeded


def test_score_compares_the_first_generated_tokens() -> None:
    answers = torch.tensor([[1, 2], [3, 4]])
    tokens = torch.tensor([[9, 9, 1, 2, 5], [9, 9, 3, 5, 4]])
    assert passkey.score(tokens, answers, 2) == [1.0, 0.0]


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
    for args, message in ((["--depth", "1.5"], "--depth 1.5: must be in [0, 1]"),
                          (["--prompt-len", "20"], "the passkey prompt needs at least"),
                          (["--turns", "2"], "--mode passkey is single-turn")):
        with pytest.raises(SystemExit) as e:
            main([*base, *args, "--out", str(tmp_path / "bad.jsonl")])
        err = capsys.readouterr().err.strip()
        assert e.value.code == 2 and message in err and len(err.splitlines()) == 1, err
    assert not (tmp_path / "bad.jsonl").exists()
