"""What the planner knows about a model: parameter shapes, block structure, dimensions.

Four sources, from most to least exact:

* our GPT (`GPTConfig`, a `--gpt n_layer=4,n_embd=128` spec, or the [model] table of a
  disttrain TOML file): built on the `meta` device, so every shape is the real one and
  no memory is allocated;
* a Hugging Face `config.json`: built on `meta` with transformers when it is installed
  (any architecture it knows), otherwise by formula for the GPT-2 and Llama families
  (Llama, Mistral, Qwen2 share the layout);
* a bare parameter count (`--params 1.3e9`): shapes are unknown, so sharding is modelled
  as an even split and the layer count and width used for activations are *assumed*
  from a GPT-3-like aspect ratio (recorded in `ModelSpec.notes`).

Parameter shapes are kept in `model.parameters()` order because two things the planner
models depend on them: FSDP pads each parameter's dim 0 to a multiple of the world size,
and ZeroRedundancyOptimizer assigns whole parameters to ranks greedily by size.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from disttrain.config import tomlfile as configfile
from disttrain.config.fp8_rules import fp8_linear_shapes
from disttrain.errors import UserError
from disttrain.plan.tp_count import tp_facts


@dataclass
class ModelSpec:
    """Sizes of one model. `param_shapes` is None when only the total is known."""

    name: str
    n_params: int
    n_layer: int
    hidden: int
    n_head: int
    ffn_hidden: int
    vocab_size: int
    max_seq: int
    gated_mlp: bool = False
    """SwiGLU-style MLP (Llama): three FFN matrices, more saved activations."""
    param_shapes: list[tuple[int, ...]] | None = None
    block_params: int = 0
    """Parameters in one transformer block: the FSDP unit that `fully_shard` wraps."""
    buffer_bytes: int = 0
    """Registered module buffers (never sharded by FSDP), at their own dtypes."""
    fp8_linears: list[tuple[int, int]] = field(default_factory=list)
    """(out, in) features of each linear layer that precision fp8 converts
    (`config.fp8_rules.converts`); for a bare count, those of the assumed shape."""
    tp_dims: list[int | None] = field(default_factory=list)
    """Per entry of `param_shapes`, the dimension tensor parallelism splits (None: kept
    whole); empty when the shapes or the plan are unknown (`tp_count.tp_facts`)."""
    tp_linears: list[tuple[str, int, int]] = field(default_factory=list)
    """(style, in, out) of every linear layer the model's TP plan splits, all layers;
    empty: the model has no plan, so the planner shows no TP degrees."""
    notes: list[str] = field(default_factory=list)

    @property
    def exact(self) -> bool:
        return self.param_shapes is not None

    @property
    def root_params(self) -> int:
        """Parameters outside the blocks (embeddings, final norm): the root FSDP unit."""
        return max(0, self.n_params - self.n_layer * self.block_params)


# ---------------------------------------------------------------- parameter count only


_SUFFIX = {"k": 1e3, "m": 1e6, "b": 1e9, "g": 1e9, "t": 1e12}


def parse_count(text: str | int | float, arg: str = "--params") -> int:
    """'1.3e9', '350M', '7B', 1.3e9 -> int. Raises UserError naming `arg` on bad input."""
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        value = float(text)
    else:
        s = str(text).strip().lower().replace("_", "")
        mult = _SUFFIX.get(s[-1:], 1.0)
        try:
            value = float(s[:-1] if s[-1:] in _SUFFIX else s) * mult
        except ValueError:
            raise UserError(f"{arg} {text!r} is not a number. Write it like 1.3e9, 350M or 7B.") from None
    if not math.isfinite(value) or value < 1:
        raise UserError(f"{arg} is {text!r}; it must be a positive parameter count, e.g. 1.3e9.")
    return int(round(value))


def from_param_count(n_params: int, vocab_size: int = 32000, max_seq: int = 2048) -> ModelSpec:
    """A decoder-only transformer of about `n_params` with an assumed shape.

    Assumes P ~ 12 L h^2 with h ~ 85 L (GPT-3 family ratios: 1.3B has L=24, h=2048);
    h is rounded to a multiple of 128 and n_head = h / 128.
    """
    layers = max(1, round((n_params / (12 * 85**2)) ** (1 / 3)))
    hidden = max(128, int(round(math.sqrt(n_params / (12 * layers)) / 128)) * 128)
    spec = ModelSpec(
        name=f"{_human(n_params)} parameters",
        n_params=n_params,
        n_layer=layers,
        hidden=hidden,
        n_head=max(1, hidden // 128),
        ffn_hidden=4 * hidden,
        vocab_size=vocab_size,
        max_seq=max_seq,
        block_params=min(n_params // layers, 12 * hidden * hidden),
    )
    # the assumed block's four matrices (qkv, attention out, MLP in and out): multiples of 128
    spec.fp8_linears = [(3 * hidden, hidden), (hidden, hidden), (4 * hidden, hidden), (hidden, 4 * hidden)] * layers
    # and its TP plan, Megatron's: fused qkv and MLP in by columns, their outputs by rows
    spec.tp_linears = [
        ("colwise", hidden, 3 * hidden),
        ("rowwise", hidden, hidden),
        ("colwise", hidden, 4 * hidden),
        ("rowwise", 4 * hidden, hidden),
    ] * layers
    spec.notes.append(
        f"shape assumed from the count alone: {layers} layers, hidden {hidden}, "
        f"vocab {vocab_size}; pass --gpt or --hf for exact activations and sharding."
    )
    return spec


def _human(n: float) -> str:
    for unit, div in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= div:
            return f"{n / div:.3g}{unit}"
    return str(int(n))


# ---------------------------------------------------------------- our GPT


def parse_gpt_spec(text: str):
    """'n_layer=4,n_embd=128' -> GPTConfig. Unknown keys and bad values raise UserError."""
    import dataclasses

    from disttrain.config.gpt_shape import GPTConfig

    fields = {f.name: f.type for f in dataclasses.fields(GPTConfig)}
    kwargs: dict[str, Any] = {}
    for item in filter(None, (s.strip() for s in text.split(","))):
        key, sep, value = item.partition("=")
        key = key.strip()
        if not sep or key not in fields:
            raise UserError(
                f"--gpt {text!r}: {item!r} is not key=value with a GPTConfig key. "
                f"Valid keys: {', '.join(fields)}; e.g. --gpt n_layer=4,n_embd=128."
            )
        kwargs[key] = _gpt_value(key, value.strip(), fields[key])
    return _gpt_config(kwargs, f"--gpt {text!r}")


def _gpt_value(key: str, value: str, tp: Any) -> Any:
    tp = str(tp)
    try:
        if "bool" in tp:
            if value.lower() not in ("true", "false", "1", "0"):
                raise ValueError
            return value.lower() in ("true", "1")
        return float(value) if "float" in tp else int(value)
    except ValueError:
        raise UserError(f"--gpt: {key}={value!r} is not a valid {tp}.") from None


def _gpt_config(kwargs: dict, where: str):
    import dataclasses

    from disttrain.config.gpt_shape import GPTConfig

    types = {f.name: str(f.type) for f in dataclasses.fields(GPTConfig)}
    for key, value in kwargs.items():
        if key not in types:
            raise UserError(f"{where}: unknown GPTConfig key {key!r}; valid keys: {', '.join(types)}.")
        want = types[key]
        ok = (
            isinstance(value, bool)
            if "bool" in want
            else isinstance(value, (int, float)) and not isinstance(value, bool)
            if "float" in want
            else isinstance(value, int) and not isinstance(value, bool)
        )
        if not ok:
            raise UserError(f"{where}: {key} = {value!r} must be {want}.")
    cfg = GPTConfig(**kwargs)
    for key in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd"):
        if getattr(cfg, key) < 1:
            raise UserError(f"{where}: {key} is {getattr(cfg, key)}; it must be at least 1.")
    if cfg.n_embd % cfg.n_head:
        raise UserError(f"{where}: n_embd ({cfg.n_embd}) must be divisible by n_head ({cfg.n_head}).")
    return cfg


def read_toml(path: str | Path) -> tuple[Any, dict]:
    """(GPTConfig from [model], the whole raw TOML) of a disttrain config file.

    The raw table lets the CLI take batch size, precision and optimizer defaults from the
    same file. Hardware checks of `disttrain.config.validate` are deliberately not run:
    a plan is usually made for a machine other than this one.
    """
    p = Path(path)
    if not p.is_file():
        raise UserError(
            f"--gpt: TOML file not found: {p}. Pass an existing disttrain config, "
            f"or a spec such as n_layer=4,n_embd=128."
        )
    raw = configfile.read_toml(p)  # bad TOML: one ConfigError naming the file and line
    model = raw.get("model", {})
    if not isinstance(model, dict):
        raise UserError(f"{p}: [model] must be a table of GPTConfig fields.")
    other = [k for k in ("factory", "hf", "hf_path") if model.get(k)]
    if other:
        # A user's model is sized from its parameters, not from GPT fields.
        raise UserError(
            f"{p}: [model] {other[0]} names a model that `disttrain plan` cannot "
            f"build from the TOML; plan it by size: --params N (its parameter "
            f"count), or --hf CONFIG.json for a Hugging Face model."
        )
    model = {k: v for k, v in model.items() if k not in ("factory", "kwargs", "hf", "hf_path", "hf_config")}
    return _gpt_config(model, f"{p} [model]"), raw


def from_gpt_config(cfg) -> ModelSpec:
    """Exact sizes of `disttrain.builtin.GPT(cfg)`, built on the meta device (no memory)."""
    import torch

    from disttrain.builtin.gpt import GPT

    with torch.device("meta"):
        model = GPT(cfg)
    spec = ModelSpec(
        name=f"GPT(n_layer={cfg.n_layer}, n_embd={cfg.n_embd}, n_head={cfg.n_head})",
        n_params=0,
        n_layer=cfg.n_layer,
        hidden=cfg.n_embd,
        n_head=cfg.n_head,
        ffn_hidden=4 * cfg.n_embd,
        vocab_size=cfg.vocab_size,
        max_seq=cfg.block_size,
    )
    return _fill_from_module(spec, model, {"Block"})


def _fill_from_module(spec: ModelSpec, model, block_classes: set[str]) -> ModelSpec:
    """Shapes (parameters() order, tied weights once), block size and buffers of a meta model."""
    params = list(model.parameters())
    spec.param_shapes = [tuple(p.shape) for p in params]
    spec.n_params = sum(p.numel() for p in params)
    blocks = [m for m in model.modules() if type(m).__name__ in block_classes]
    if blocks:
        spec.n_layer = len(blocks)
        spec.block_params = max(sum(p.numel() for p in b.parameters()) for b in blocks)
    spec.buffer_bytes = sum(b.numel() * b.element_size() for b in model.buffers())
    spec.fp8_linears = fp8_linear_shapes(model)
    spec.tp_dims, spec.tp_linears = tp_facts(model)
    return spec


# ---------------------------------------------------------------- Hugging Face config.json


def from_hf_config(path: str | Path) -> ModelSpec:
    """Sizes from a local config.json (or a folder holding one). Never downloads."""
    p = Path(path)
    if p.is_dir():
        p = p / "config.json"
    if not p.is_file():
        raise UserError(f"--hf: no such file {p}. Pass the path of a Hugging Face config.json (nothing is downloaded).")
    try:
        cfg = json.loads(p.read_text())
    except json.JSONDecodeError as e:
        raise UserError(f"--hf: {p} is not valid JSON: {e}.") from None
    if not isinstance(cfg, dict) or "model_type" not in cfg:
        raise UserError(f"--hf: {p} has no 'model_type'; it does not look like a Hugging Face config.json.")
    spec = _hf_dims(cfg, p)
    try:
        import transformers  # noqa: F401
    except ImportError:
        return _hf_formula(spec, cfg, p)
    return _hf_meta(spec, cfg, p)


def _hf_dims(cfg: dict, p: Path) -> ModelSpec:
    def first(*keys, default=None):
        for k in keys:
            if cfg.get(k) is not None:
                return cfg[k]
        if default is None:
            raise UserError(f"--hf: {p} lacks any of {', '.join(keys)}.")
        return default

    hidden = int(first("hidden_size", "n_embd", "d_model"))
    gated = cfg.get("hidden_act") in ("silu", "swiglu", "gelu_pytorch_tanh") and "intermediate_size" in cfg
    return ModelSpec(
        name=f"{cfg['model_type']} ({p.name})",
        n_params=0,
        n_layer=int(first("num_hidden_layers", "n_layer", "num_layers")),
        hidden=hidden,
        n_head=int(first("num_attention_heads", "n_head")),
        ffn_hidden=int(first("intermediate_size", "n_inner", default=4 * hidden) or 4 * hidden),
        vocab_size=int(first("vocab_size")),
        max_seq=int(first("max_position_embeddings", "n_positions", default=2048)),
        gated_mlp=gated,
    )


def _hf_meta(spec: ModelSpec, cfg: dict, p: Path) -> ModelSpec:
    import torch
    import transformers

    kwargs = {k: v for k, v in cfg.items() if k != "model_type"}
    try:
        config = transformers.AutoConfig.for_model(cfg["model_type"], **kwargs)
    except (ValueError, KeyError) as e:
        raise UserError(
            f"--hf: transformers does not know model_type {cfg['model_type']!r} "
            f"({e}). Use --params with the parameter count instead."
        ) from None
    with torch.device("meta"):
        try:
            model = transformers.AutoModelForCausalLM.from_config(config)
        except ValueError:  # not a causal LM (encoder, seq2seq): the bare model
            model = transformers.AutoModel.from_config(config)
    spec.notes.append("counted by building the model on the meta device with transformers.")
    return _fill_from_module(spec, model, set(getattr(model, "_no_split_modules", None) or ()))


def _hf_formula(spec: ModelSpec, cfg: dict, p: Path) -> ModelSpec:
    """Shapes by formula, in parameters() order, for the families we know by heart."""
    h, L, V, f = spec.hidden, spec.n_layer, spec.vocab_size, spec.ffn_hidden
    kind = cfg["model_type"]
    tied = cfg.get("tie_word_embeddings", kind == "gpt2")
    if kind == "gpt2":
        block = [(h,), (h,), (h, 3 * h), (3 * h,), (h, h), (h,), (h,), (h,), (h, f), (f,), (f, h), (h,)]
        shapes = [(V, h), (spec.max_seq, h)] + block * L + [(h,), (h,)]
        linears: list[tuple[int, int]] = []  # GPT-2's matrices are transformers' Conv1D, which fp8 does not convert
    elif kind in ("llama", "mistral", "qwen2"):
        hd = int(cfg.get("head_dim") or h // spec.n_head)
        q, kv = spec.n_head * hd, int(cfg.get("num_key_value_heads") or spec.n_head) * hd
        qkv_bias = bool(cfg.get("attention_bias", False)) or kind == "qwen2"
        o_bias = bool(cfg.get("attention_bias", False)) and kind != "qwen2"
        mlp_bias = bool(cfg.get("mlp_bias", False))

        def lin(out: int, inp: int, bias: bool) -> list[tuple[int, ...]]:
            return [(out, inp)] + ([(out,)] if bias else [])

        block = (
            lin(q, h, qkv_bias)
            + lin(kv, h, qkv_bias)
            + lin(kv, h, qkv_bias)
            + lin(h, q, o_bias)
            + lin(f, h, mlp_bias)
            + lin(f, h, mlp_bias)
            + lin(h, f, mlp_bias)
            + [(h,), (h,)]
        )
        shapes = [(V, h)] + block * L + [(h,)]
        linears = [(q, h), (kv, h), (kv, h), (h, q), (f, h), (f, h), (h, f)] * L
        spec.gated_mlp = True
    else:
        raise UserError(
            f"--hf: model_type {kind!r} needs transformers to be counted (pip install transformers), or pass --params."
        )
    if not tied:
        shapes.append((V, h))
        linears.append((V, h))  # an untied LM head is an nn.Linear
    spec.param_shapes = shapes
    spec.n_params = sum(math.prod(s) for s in shapes)
    spec.block_params = sum(math.prod(s) for s in block)
    spec.fp8_linears = [(o, i) for o, i in linears if o % 16 == 0 and i % 16 == 0]
    spec.notes.append(
        f"counted by the {kind} formula (transformers is not installed), which knows no "
        f"tensor-parallel plan: no TP rows."
    )
    return spec


# ---------------------------------------------------------------- one entry point


def resolve_model(model: Any) -> ModelSpec:
    """ModelSpec | GPTConfig | parameter count | 'k=v,...' | path (.toml/.json/dir) -> ModelSpec."""
    if isinstance(model, ModelSpec):
        return model
    if isinstance(model, (int, float)) and not isinstance(model, bool):
        return from_param_count(parse_count(model))
    if type(model).__name__ == "GPTConfig":
        return from_gpt_config(model)
    if isinstance(model, (str, Path)):
        s = str(model)
        if s.endswith(".toml"):
            return from_gpt_config(read_toml(s)[0])
        if s.endswith(".json") or Path(s).is_dir():
            return from_hf_config(s)
        if "=" in s:
            return from_gpt_config(parse_gpt_spec(s))
        return from_param_count(parse_count(s))
    raise UserError(
        f"cannot plan for a model given as {type(model).__name__}; pass a parameter "
        f"count, a GPTConfig, a TOML path or a Hugging Face config.json path."
    )
