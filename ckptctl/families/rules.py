"""Megatron ↔ Hugging Face families as declarative tables of two-way rules.

A rule relates named Megatron tensors to named HF tensors row by row, inside a scope (the
model, one layer, one expert): `{L}` in a name is the layer, `{e}` the expert. One rule
says both directions and the Megatron tensors' shapes and TP kinds:
- `to_hf` turns views of the Megatron tensors into HF tensors (`base.HFTensor`), each
  checked against the shape the config implies (export-hf);
- `megatron_shapes` names the Megatron tensors and their shapes; `to_hf` over a model of
  such tensors not written yet, read backwards (`base.reversed_pieces`), says which HF
  rows each of them is (import-hf): a row is a row whichever way it goes;
- `megatron_tensors` gives each Megatron name pattern with its TP kind (`COLUMN`, `ROW`,
  `REPLICATED`, or a fused kind of `megatron.rows.FUSED_PARTS`): what Megatron-aware reshard
  looks names up in (`registry.megatron_tp_kind`).
A family (`Family`) is its rules for the whole model and for each kind of layer; nothing
else decides what is exported or imported, and a tensor no rule claims is refused.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Callable, ClassVar, Iterable, Iterator, Protocol, Sequence

from ckptctl.util.errors import CheckpointError, UsageError
from ckptctl.families.base import ExportContext, HFConfig, HFTensor, MegatronSpec, RowView, Shapes, TiedHead, check_shape
from ckptctl.families.protocol import Naming
from ckptctl.megatron.rows import SWIGLU_PARTS, TpKind

COLUMN, ROW, REPLICATED = TpKind.COLUMN, TpKind.ROW, TpKind.REPLICATED
SWIGLU, GDN_IN_PROJ, GDN_CONV1D = TpKind.SWIGLU, TpKind.GDN_IN_PROJ, TpKind.GDN_CONV1D
MAMBA_IN_PROJ, MAMBA_CONV1D = TpKind.MAMBA_IN_PROJ, TpKind.MAMBA_CONV1D
"""The TP kinds (`megatron.rows.TpKind`) under the short names the family tables use."""

MG_LAYER = "decoder.layers.{L}."
HF_LAYER = "model.layers.{L}."


CONFIG_SIZES = {"hidden": "hidden_size", "vocab": "vocab_size", "ffn": "intermediate_size",
                "moe_ffn": "moe_intermediate_size", "shared_ffn": "shared_expert_intermediate_size",
                "experts": "num_experts", "layers": "num_hidden_layers"}
"""Sizes rule shapes name, read from the config when a rule needs them (a MoE config may lack
`intermediate_size`)."""


@dataclass(frozen=True)
class Dims:
    """The sizes rule shapes are written in (`("hidden", "ffn")`; an int stands for itself):
    `derived` from the head layouts, others read from the config (`CONFIG_SIZES`); and the head
    layouts the regrouping rules need."""

    config: HFConfig
    derived: dict[str, int] = field(default_factory=dict)
    heads: dict[str, Any] = field(default_factory=dict)

    def size(self, name: str | int) -> int:
        if isinstance(name, int):
            return name
        if name in self.derived:
            return self.derived[name]
        return self.config.int(CONFIG_SIZES[name])

    def shape(self, names: Sequence[str | int]) -> tuple[int, ...]:
        return tuple(self.size(n) for n in names)


@dataclass(frozen=True)
class Scope:
    """Where a rule applies: Megatron and HF name prefixes, and the expert index for `{e}`."""

    mg: str
    hf: str
    expert: int | None = None

    def name(self, side: str, template: str) -> str:
        prefix = self.mg if side == "mg" else self.hf
        return prefix + (template.format(e=self.expert) if self.expert is not None else template)


class Rule(Protocol):
    def to_hf(self, ctx: ExportContext, dims: Dims, at: Scope, out: dict[str, HFTensor]) -> None: ...

    def megatron_shapes(self, dims: Dims, spec: MegatronSpec, at: Scope, shapes: Shapes) -> None: ...

    def megatron_tensors(self) -> Iterable[tuple[str, str]]: ...


def fused_shapes(spec: MegatronSpec, shapes: Shapes, name: str, parts: tuple[str, ...], rows: tuple[int, ...],
                 trailing: tuple[int, ...]) -> None:
    """A tensor Megatron fuses per TP rank: whole (TP-blocked at the spec's TP) or its components."""
    if spec.split:
        for part, n in zip(parts, rows):
            shapes[name + part] = (n, *trailing)
    else:
        shapes[name] = (sum(rows), *trailing)


def put(out: dict[str, HFTensor], hf: HFTensor, shape: tuple[int, ...], cfg: HFConfig) -> None:
    if hf.name in out:
        raise CheckpointError(hf.sources[0], f"{hf.name} would be written twice")
    out[hf.name] = check_shape(hf, shape, cfg)


# --------------------------------------------------------------------------------------
# Rule kinds
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Same:
    """One Megatron tensor (the first present of `mg`; an import writes the first) is one HF
    tensor, row for row; `add` is a constant the HF side adds (Megatron's zero-centred norms).
    `optional`: only where the source has it (an export: the checkpoint; an import: the folder)."""

    hf: str
    mg: tuple[str, ...]
    shape: tuple[str | int, ...]
    tp: str
    optional: bool = False
    add: float = 0.0

    def to_hf(self, ctx: ExportContext, dims: Dims, at: Scope, out: dict[str, HFTensor]) -> None:
        names = [at.name("mg", n) for n in self.mg]
        if self.optional and ctx.model.first(*names) is None:
            return
        put(out, HFTensor(at.name("hf", self.hf), (ctx.model.view(*names),), add=self.add), dims.shape(self.shape),
            dims.config)

    def megatron_shapes(self, dims: Dims, spec: MegatronSpec, at: Scope, shapes: Shapes) -> None:
        if not self.optional or spec.has(at.name("hf", self.hf)):
            shapes[at.name("mg", self.mg[0])] = dims.shape(self.shape)

    def megatron_tensors(self) -> Iterable[tuple[str, str]]:
        return ((name, self.tp) for name in self.mg)


@dataclass(frozen=True)
class VocabRows:
    """Embedding or output layer: Megatron pads the vocab rows (to a multiple of 128·TP by
    default); the HF tensor has `vocab_size` rows. With `tied_by` set, a config that ties it
    (default `tie_default`) to `tied_to` has no HF tensor for it, and a Megatron one is left
    unexported once export-hf has proven its vocab rows equal to `tied_to`'s (`base.TiedHead`)."""

    hf: str
    mg: str
    tied_by: str | None = None
    tie_default: bool = False
    tied_to: str = "model.embed_tokens.weight"

    def tied(self, cfg: HFConfig) -> bool:
        return self.tied_by is not None and cfg.flag(self.tied_by, self.tie_default)

    def to_hf(self, ctx: ExportContext, dims: Dims, at: Scope, out: dict[str, HFTensor]) -> None:
        cfg, m = ctx.config, ctx.model
        name = at.name("mg", self.mg)
        if self.tied(cfg):
            if m.has(name):
                view = m.view(name)
                rows = view.take(0, dims.size("vocab")) if view.rows >= dims.size("vocab") else view
                ctx.tied_heads.append(TiedHead(HFTensor(at.name("hf", self.hf), (rows,)), self.tied_to, self.tied_by))
            return
        if self.tied_by is not None and not m.has(name):
            raise CheckpointError(m.ckpt.path, f"no {m.prefix}{name} but {cfg.path.name} has {self.tied_by} "
                                               f"false (wrong --hf-config?)")
        vocab = dims.size("vocab")
        view = m.view(name)
        if view.rows < vocab:
            raise CheckpointError(view.fqn, f"has {view.rows} vocab rows, fewer than vocab_size={vocab} of the config")
        put(out, HFTensor(at.name("hf", self.hf), (view.take(0, vocab),)), dims.shape(("vocab", "hidden")), cfg)

    def megatron_shapes(self, dims: Dims, spec: MegatronSpec, at: Scope, shapes: Shapes) -> None:
        if not self.tied(dims.config):
            shapes[at.name("mg", self.mg)] = (spec.padded_vocab, dims.size("hidden"))

    def megatron_tensors(self) -> Iterable[tuple[str, str]]:
        return ((self.mg, COLUMN),)


@dataclass(frozen=True)
class Attention:
    """Head layout of one attention block, all from the HF config (head_dim read, never derived when given)."""

    heads: int
    groups: int
    head_dim: int
    hidden: int
    gated: bool = False

    @property
    def per_group(self) -> int:
        return self.heads // self.groups

    @property
    def q_rows(self) -> int:
        """HF `q_proj` rows (with gated attention, each head's query then its gate)."""
        return self.heads * self.head_dim * (2 if self.gated else 1)

    @property
    def qkv_rows(self) -> int:
        return self.q_rows + 2 * self.groups * self.head_dim

    @classmethod
    def from_config(cls, cfg: HFConfig, head_dim_default: int | None, gated: bool = False,
                    kv_heads_default: int | None = None) -> "Attention":
        heads = cfg.int("num_attention_heads")
        groups = cfg.int("num_key_value_heads", heads if kv_heads_default is None else kv_heads_default)
        hidden = cfg.int("hidden_size")
        if groups == 0 or heads % groups:
            raise UsageError(f"{cfg.path}: num_attention_heads={heads} is not a multiple of "
                             f"num_key_value_heads={groups}")
        default = head_dim_default if head_dim_default is not None else hidden // max(heads, 1)
        return cls(heads, groups, cfg.int("head_dim", default), hidden, gated)

    def sizes(self) -> dict[str, int]:
        return {"head_dim": self.head_dim, "q_rows": self.q_rows, "kv_rows": self.groups * self.head_dim,
                "q_width": self.heads * self.head_dim, "qkv_rows": self.qkv_rows}


def qkv_views(qkv: RowView, att: Attention) -> tuple[list[RowView], list[RowView], list[RowView]]:
    """Split Megatron `linear_qkv` rows (weight or bias) into the views of HF q, k and v.

    Rows are grouped per query group g: `[q_g (hpg·d), k_g (d), v_g (d)]`; with gated
    attention `[q_g, gate_g, k_g, v_g]` and HF `q_proj` interleaves per head `[q_h; gate_h]`.
    The global layout is the same at every TP size (TP ranks own whole groups).
    """
    d, hpg = att.head_dim, att.per_group
    q_rows = hpg * d
    parts = [q_rows, q_rows, d, d] if att.gated else [q_rows, d, d]
    if qkv.rows != att.groups * sum(parts):
        raise CheckpointError(qkv.fqn, f"has {qkv.rows} rows, but the config implies {att.groups} query groups of "
                                       f"{sum(parts)} = {att.groups * sum(parts)} (num_attention_heads, "
                                       f"num_key_value_heads, head_dim)")
    q, k, v = [], [], []
    for group in qkv.chunks(att.groups):
        if att.gated:
            q_g, gate_g, k_g, v_g = group.split(parts)
            for q_h, gate_h in zip(q_g.chunks(hpg), gate_g.chunks(hpg)):
                q += [q_h, gate_h]
        else:
            q_g, k_g, v_g = group.split(parts)
            q.append(q_g)
        k.append(k_g)
        v.append(v_g)
    return q, k, v


@dataclass(frozen=True)
class GroupedQKV:
    """Megatron `linear_qkv.<kind>` (grouped per query group, `qkv_views`) ↔ HF `q/k/v_proj.<kind>`.
    `required`: True demands it; a config key demands it when the config sets that flag
    (`attention_bias`); else it is exported where the checkpoint has it."""

    kind: str = "weight"
    required: bool | str = True
    module: str = "self_attn"
    """The HF attention module's name (Nemotron-H: `mixer`)."""

    @property
    def mg(self) -> str:
        return f"self_attention.linear_qkv.{self.kind}"

    def hf(self, at: Scope) -> list[str]:
        return [at.name("hf", f"{self.module}.{p}_proj.{self.kind}") for p in "qkv"]

    def demanded(self, cfg: HFConfig) -> bool:
        return self.required if isinstance(self.required, bool) else cfg.flag(self.required)

    def to_hf(self, ctx: ExportContext, dims: Dims, at: Scope, out: dict[str, HFTensor]) -> None:
        m, att = ctx.model, dims.heads["attention"]
        name = at.name("mg", self.mg)
        if not m.has(name):
            if self.demanded(dims.config):
                raise m.missing(name)
            return
        trailing = (dims.size("hidden"),) if self.kind == "weight" else ()
        rows = dims.shape(("q_rows", "kv_rows", "kv_rows"))
        for hf, views, n in zip(self.hf(at), qkv_views(m.view(name), att), rows):
            put(out, HFTensor(hf, tuple(views)), (n, *trailing), dims.config)

    def megatron_shapes(self, dims: Dims, spec: MegatronSpec, at: Scope, shapes: Shapes) -> None:
        att = dims.heads["attention"]
        if att.groups % spec.tp:
            raise UsageError(f"{dims.config.path}: num_key_value_heads={att.groups} does not divide by TP {spec.tp} "
                             "(Megatron gives each TP rank whole query groups)")
        if self.demanded(dims.config) or spec.has(self.hf(at)[0]):
            shapes[at.name("mg", self.mg)] = (att.qkv_rows, *((att.hidden,) if self.kind == "weight" else ()))

    def megatron_tensors(self) -> Iterable[tuple[str, str]]:
        return ((self.mg, COLUMN),)


@dataclass(frozen=True)
class GatedMLP:
    """A gated fc1 ↔ HF `gate_proj` + `up_proj` (`.weight`, and `.bias` where present).

    Megatron saves fc1 split (`<name>_w`, `<name>_v`: gate, up; TP-invariant) or fused `<name>`
    TP-blocked `[W_0; V_0; W_1; V_1; …]` at the training TP (the expert TP for experts). `mg`
    lists the fc1 names, `{kind}` standing for weight or bias, in order of preference (an
    import writes the first). Megatron-FSDP splits SwiGLU only: `splits` False (GeGLU) keeps
    an import's fc1 fused whatever `--split-fused` says."""

    hf: str
    mg: tuple[str, ...]
    ffn: str
    expert: bool = False
    gate: str = "gate_proj"
    up: str = "up_proj"
    """The HF names of the two halves under `hf` (Mixtral: `w1`, `w3`)."""
    splits: bool = True

    def names(self, at: Scope, kind: str) -> list[str]:
        return [at.name("mg", n.replace("{kind}", kind)) for n in self.mg]

    def to_hf(self, ctx: ExportContext, dims: Dims, at: Scope, out: dict[str, HFTensor]) -> None:
        m = ctx.model
        ffn, hidden = dims.size(self.ffn), dims.size("hidden")
        for kind, shape in (("weight", (ffn, hidden)), ("bias", (ffn,))):
            names = self.names(at, kind)
            base = next((b for b in names if m.has(b) or m.has(b + SWIGLU_PARTS[0])), None)
            if base is None:
                if kind == "bias":
                    continue
                raise m.missing(*names)
            gate, up = m.components(base, SWIGLU_PARTS, (ffn, ffn), ctx.expert_tp if self.expert else ctx.tp)
            put(out, HFTensor(at.name("hf", f"{self.hf}{self.gate}.{kind}"), (gate,)), shape, dims.config)
            put(out, HFTensor(at.name("hf", f"{self.hf}{self.up}.{kind}"), (up,)), shape, dims.config)

    def megatron_shapes(self, dims: Dims, spec: MegatronSpec, at: Scope, shapes: Shapes) -> None:
        ffn = dims.size(self.ffn)
        for kind, trailing in (("weight", (dims.size("hidden"),)), ("bias", ())):
            if kind == "bias" and not spec.has(at.name("hf", f"{self.hf}{self.gate}.bias")):
                continue
            fused_shapes(spec if self.splits else replace(spec, split=False), shapes, self.names(at, kind)[0],
                         SWIGLU_PARTS, (ffn, ffn), trailing)

    def megatron_tensors(self) -> Iterable[tuple[str, str]]:
        return ((n.replace("{kind}", kind), SWIGLU) for n in self.mg for kind in ("weight", "bias"))


def swiglu(hf: str, mg: Sequence[str], ffn: str, expert: bool = False,
           names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj"), splits: bool = True
           ) -> tuple[Rule, ...]:
    """A gated MLP: fc1 (`GatedMLP`), fc2 ↔ `down_proj` (RowParallel) and its bias where present.
    `mg`: the MLP's fc1 names with `{fc}` for linear_fc1/linear_fc2 and `{kind}` for weight/bias;
    `names`: the HF gate, up and down projections under `hf`; `splits`: False for GeGLU."""
    gate, up, down = names
    fc1 = tuple(n.replace("{fc}", "linear_fc1") for n in mg)
    fc2 = tuple(n.replace("{fc}", "linear_fc2") for n in mg)
    return (GatedMLP(hf, fc1, ffn, expert, gate, up, splits),
            Same(f"{hf}{down}.weight", tuple(n.replace("{kind}", "weight") for n in fc2), ("hidden", ffn), ROW),
            Same(f"{hf}{down}.bias", tuple(n.replace("{kind}", "bias") for n in fc2), ("hidden",), REPLICATED,
                 optional=True))


@dataclass(frozen=True)
class Block:
    """Rules applied to every layer `when` says (all layers when None), or per expert of such
    a layer (`per_expert`: `{e}` runs over `num_experts`)."""

    rules: tuple[Rule, ...]
    when: Callable[[HFConfig, int], bool] | None = None
    per_expert: bool = False

    def scopes(self, dims: Dims, layer: int, hf_layer: str = HF_LAYER, mg: str | None = None) -> Iterator[Scope]:
        """`mg`: the Megatron prefix when it is not decoder layer `layer` (an MTP layer's)."""
        mg, hf = mg or MG_LAYER.format(L=layer), hf_layer.format(L=layer)
        if self.when is not None and not self.when(dims.config, layer):
            return
        if self.per_expert:
            yield from (Scope(mg, hf, e) for e in range(dims.size("experts")))
        else:
            yield Scope(mg, hf)


@dataclass(frozen=True)
class Mtp:
    """Multi-token prediction layers after the decoder (DeepSeek-V3; Megatron-Bridge's mapping):
    Megatron `mtp.layers.{i}.` holds `rules` (its norms and projection) around one decoder layer
    under `{i}.<inner>.`, HF layer N + i (N decoder layers) holds both. `count` names the config
    key with their number; an export writes those the checkpoint holds, an import those the
    folder holds."""

    count: str
    rules: tuple[Rule, ...]
    inner: tuple[str, ...] = ("mtp_model_layer.", "transformer_layer.")
    """The decoder layer's name inside, as an import writes it first: Megatron-Bridge's (newer
    megatron-core), then megatron-core 0.16's."""

    def layers(self, cfg: HFConfig) -> range:
        return range(cfg.int(self.count, 0))


@dataclass(frozen=True)
class Family:
    """A Megatron-Core model family: the HF `model_type`s it serves, the sizes its rules are
    written in (`dims`, from the config), and its rules: `model` around the layers (embeddings
    first, then the rest after the layers), `layers` per layer, in the order they apply."""

    name: str
    model_types: tuple[str, ...]
    dims: Callable[[HFConfig], Dims]
    embedding: tuple[Rule, ...]
    layers: tuple[Block, ...]
    final: tuple[Rule, ...]
    hf_layer: str = HF_LAYER
    """The HF name of layer `{L}` (Nemotron-H: `backbone.layers.{L}.`)."""
    mtp: Mtp | None = None
    naming: ClassVar[Naming] = Naming.MEGATRON

    def gated_mlp(self) -> bool:
        """Whether its MLPs are gated (fc1 `[W; V]` per TP rank) whatever the activation: a llama
        with `hidden_act: gelu` is still gated, and Gemma's GeGLU is."""
        return any(isinstance(rule, GatedMLP) for block in self.layers for rule in block.rules)

    def applied(self, dims: Dims, mtp_inner: Callable[[int], str | None] = lambda i: None
                ) -> Iterator[tuple[Rule, Scope]]:
        """Every rule with where it applies; MTP layer i where `mtp_inner(i)` names its decoder layer."""
        top = Scope("", "")
        yield from ((rule, top) for rule in self.embedding)
        layers = dims.size("layers")
        for layer in range(layers):
            for block in self.layers:
                for at in block.scopes(dims, layer, self.hf_layer):
                    yield from ((rule, at) for rule in block.rules)
        for i in self.mtp.layers(dims.config) if self.mtp is not None else ():
            inner = mtp_inner(i)
            if inner is None:
                continue
            hf = self.hf_layer.format(L=layers + i)
            yield from ((rule, Scope(f"mtp.layers.{i}.", hf)) for rule in self.mtp.rules)
            for block in self.layers:
                for at in block.scopes(dims, layers + i, self.hf_layer, f"mtp.layers.{i}.{inner}"):
                    yield from ((rule, at) for rule in block.rules)
        yield from ((rule, top) for rule in self.final)

    def mtp_prefixes(self, cfg: HFConfig) -> tuple[str, ...]:
        """The HF names of the MTP layers (no transformers model class holds them)."""
        if self.mtp is None:
            return ()
        layers = self.dims(cfg).size("layers")
        return tuple(self.hf_layer.format(L=layers + i) for i in self.mtp.layers(cfg))

    def to_hf(self, ctx: ExportContext) -> dict[str, HFTensor]:
        dims = self.dims(ctx.config)
        out: dict[str, HFTensor] = {}

        def inner(i: int) -> str | None:  # the name the checkpoint's MTP layer i holds its decoder layer under
            return next((p for p in self.mtp.inner if ctx.model.has_prefix(f"mtp.layers.{i}.{p}")), None)

        for rule, at in self.applied(dims, inner):
            rule.to_hf(ctx, dims, at, out)
        return out

    def megatron_shapes(self, cfg: HFConfig, spec: MegatronSpec) -> Shapes:
        dims = self.dims(cfg)
        shapes: Shapes = {}
        mtp = self.mtp_prefixes(cfg)

        def inner(i: int) -> str | None:
            return self.mtp.inner[0] if any(n.startswith(mtp[i]) for n in spec.hf_names) else None

        for rule, at in self.applied(dims, inner):
            rule.megatron_shapes(dims, spec, at, shapes)
        return shapes

    def megatron_tensors(self) -> Iterator[tuple[str, str]]:
        """Every Megatron name pattern its rules know (`{L}` layer, `{e}` expert) with its TP kind."""
        for rule in (*self.embedding, *self.final):
            yield from rule.megatron_tensors()
        for block in self.layers:
            for rule in block.rules:
                yield from ((MG_LAYER + name, kind) for name, kind in rule.megatron_tensors())
                for inner in self.mtp.inner if self.mtp is not None else ():
                    yield from ((f"mtp.layers.{{L}}.{inner}{name}", kind) for name, kind in rule.megatron_tensors())
        for rule in self.mtp.rules if self.mtp is not None else ():
            yield from ((f"mtp.layers.{{L}}.{name}", kind) for name, kind in rule.megatron_tensors())
