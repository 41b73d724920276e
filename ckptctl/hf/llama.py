"""Llama, Qwen2 and Qwen3 dense models: Megatron GPT names → Hugging Face names and splits.

Also the building blocks the other families reuse: embeddings and output layer (vocab
padding sliced off, tied embeddings written once), grouped-query attention (per query
group `[q, k, v]`, or `[q, gate, k, v]` with gated attention), and SwiGLU MLPs whose fc1
is saved split (`_w`/`_v`) or fused TP-blocked.
"""

from __future__ import annotations

from dataclasses import dataclass

from ckptctl.errors import CheckpointError, UsageError
from ckptctl.hf.base import ExportContext, HFConfig, HFTensor, MegatronSpec, RowView, Shapes, check_shape
from ckptctl.megatron import SWIGLU_PARTS

LAYER = "decoder.layers.{}."
HF_LAYER = "model.layers.{}."

# HF name ← Megatron names (first present wins); per layer under the prefixes above.
INPUT_NORM = ("self_attention.linear_qkv.layer_norm_weight", "input_layernorm.weight")
POST_ATTENTION_NORM = ("mlp.linear_fc1.layer_norm_weight", "pre_mlp_layernorm.weight")
Q_NORM = ("self_attention.q_layernorm.weight",)
K_NORM = ("self_attention.k_layernorm.weight",)
O_PROJ = ("self_attention.linear_proj.weight",)
O_PROJ_BIAS = ("self_attention.linear_proj.bias",)
EMBED = "embedding.word_embeddings.weight"
OUTPUT = "output_layer.weight"
FINAL_NORM = "decoder.final_layernorm.weight"


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

    @classmethod
    def from_config(cls, cfg: HFConfig, head_dim_default: int | None, gated: bool = False) -> "Attention":
        heads = cfg.int("num_attention_heads")
        groups = cfg.int("num_key_value_heads", heads)
        hidden = cfg.int("hidden_size")
        if groups == 0 or heads % groups:
            raise UsageError(f"{cfg.path}: num_attention_heads={heads} is not a multiple of "
                             f"num_key_value_heads={groups}")
        default = head_dim_default if head_dim_default is not None else hidden // max(heads, 1)
        return cls(heads, groups, cfg.int("head_dim", default), hidden, gated)


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


def embeddings(ctx: ExportContext, out: dict[str, HFTensor]) -> None:
    """`model.embed_tokens` (vocab padding sliced off)."""
    cfg = ctx.config
    vocab, hidden = cfg.int("vocab_size"), cfg.int("hidden_size")
    put(out, HFTensor("model.embed_tokens.weight", (vocab_rows(ctx, EMBED, vocab),)), (vocab, hidden), cfg)


def output_layer(ctx: ExportContext, out: dict[str, HFTensor], tie_default: bool = False) -> None:
    """`model.norm` and `lm_head` (not written when the config ties it to the embeddings)."""
    cfg, m = ctx.config, ctx.model
    vocab, hidden = cfg.int("vocab_size"), cfg.int("hidden_size")
    put(out, HFTensor("model.norm.weight", (m.view(FINAL_NORM),)), (hidden,), cfg)
    tied = cfg.flag("tie_word_embeddings", tie_default)
    if tied:
        if m.has(OUTPUT):
            m.used.add(OUTPUT)
            ctx.notes.append(f"{m.prefix}{OUTPUT} not exported: the config ties lm_head to the embeddings")
        return
    if not m.has(OUTPUT):
        raise CheckpointError(m.ckpt.path, f"no {m.prefix}{OUTPUT} but {cfg.path.name} has tie_word_embeddings "
                                           f"false (wrong --hf-config?)")
    put(out, HFTensor("lm_head.weight", (vocab_rows(ctx, OUTPUT, vocab),)), (vocab, hidden), cfg)


def vocab_rows(ctx: ExportContext, name: str, vocab: int) -> RowView:
    view = ctx.model.view(name)
    if view.rows < vocab:
        raise CheckpointError(view.fqn, f"has {view.rows} vocab rows, fewer than vocab_size={vocab} of the config")
    return view.take(0, vocab)


def attention(ctx: ExportContext, out: dict[str, HFTensor], layer: int, att: Attention,
              qk_norm: bool, bias: bool | None) -> None:
    """`self_attn.{q,k,v,o}_proj` (+ biases, + q/k norms) and `input_layernorm` of one layer.

    `bias` True requires q/k/v biases (Qwen2), None exports them when the checkpoint has them.
    """
    cfg, m = ctx.config, ctx.model
    mg, hf = LAYER.format(layer), HF_LAYER.format(layer)
    put(out, HFTensor(hf + "input_layernorm.weight", (m.view(*(mg + n for n in INPUT_NORM)),)), (att.hidden,), cfg)
    q, k, v = qkv_views(m.view(mg + "self_attention.linear_qkv.weight"), att)
    q_rows = att.heads * att.head_dim * (2 if att.gated else 1)
    kv_rows = att.groups * att.head_dim
    put(out, HFTensor(hf + "self_attn.q_proj.weight", tuple(q)), (q_rows, att.hidden), cfg)
    put(out, HFTensor(hf + "self_attn.k_proj.weight", tuple(k)), (kv_rows, att.hidden), cfg)
    put(out, HFTensor(hf + "self_attn.v_proj.weight", tuple(v)), (kv_rows, att.hidden), cfg)
    has_bias = m.has(mg + "self_attention.linear_qkv.bias")
    if bias and not has_bias:
        raise m.missing(mg + "self_attention.linear_qkv.bias")
    if has_bias:
        qb, kb, vb = qkv_views(m.view(mg + "self_attention.linear_qkv.bias"), att)
        put(out, HFTensor(hf + "self_attn.q_proj.bias", tuple(qb)), (q_rows,), cfg)
        put(out, HFTensor(hf + "self_attn.k_proj.bias", tuple(kb)), (kv_rows,), cfg)
        put(out, HFTensor(hf + "self_attn.v_proj.bias", tuple(vb)), (kv_rows,), cfg)
    put(out, HFTensor(hf + "self_attn.o_proj.weight", (m.view(*(mg + n for n in O_PROJ)),)),
        (att.hidden, att.heads * att.head_dim), cfg)
    if m.first(*(mg + n for n in O_PROJ_BIAS)):
        put(out, HFTensor(hf + "self_attn.o_proj.bias", (m.view(*(mg + n for n in O_PROJ_BIAS)),)), (att.hidden,), cfg)
    if qk_norm:
        put(out, HFTensor(hf + "self_attn.q_norm.weight", (m.view(*(mg + n for n in Q_NORM)),)), (att.head_dim,), cfg)
        put(out, HFTensor(hf + "self_attn.k_norm.weight", (m.view(*(mg + n for n in K_NORM)),)), (att.head_dim,), cfg)


def swiglu(ctx: ExportContext, out: dict[str, HFTensor], mg_mlp: str, hf_mlp: str, ffn: int,
           expert: bool = False, fc1: str = "linear_fc1", fc2: str = "linear_fc2", index: str = "") -> None:
    """`gate_proj` / `up_proj` / `down_proj` (+ biases) of one SwiGLU MLP.

    fc1 is `{fc1}.weight{index}_w` + `_v` (gate, up; TP-invariant) or fused
    `{fc1}.weight{index}` TP-blocked `[W_0; V_0; W_1; V_1; …]` at the training TP
    (for experts, the expert TP).
    """
    cfg, m = ctx.config, ctx.model
    hidden = cfg.int("hidden_size")
    tp = ctx.expert_tp if expert else ctx.tp
    for kind, shape in (("weight", (ffn, hidden)), ("bias", (ffn,))):
        base = f"{mg_mlp}{fc1}.{kind}{index}"
        if kind == "bias" and not (m.has(base) or m.has(base + "_w")):
            continue
        gate, up = m.components(base, SWIGLU_PARTS, (ffn, ffn), tp)
        put(out, HFTensor(f"{hf_mlp}gate_proj.{kind}", (gate,)), shape, cfg)
        put(out, HFTensor(f"{hf_mlp}up_proj.{kind}", (up,)), shape, cfg)
    put(out, HFTensor(hf_mlp + "down_proj.weight", (m.view(f"{mg_mlp}{fc2}.weight{index}"),)), (hidden, ffn), cfg)
    if m.has(f"{mg_mlp}{fc2}.bias{index}"):
        put(out, HFTensor(hf_mlp + "down_proj.bias", (m.view(f"{mg_mlp}{fc2}.bias{index}"),)), (hidden,), cfg)


def post_attention_norm(ctx: ExportContext, out: dict[str, HFTensor], layer: int) -> None:
    m = ctx.model
    mg = LAYER.format(layer)
    put(out, HFTensor(HF_LAYER.format(layer) + "post_attention_layernorm.weight",
                      (m.view(*(mg + n for n in POST_ATTENTION_NORM)),)), (ctx.config.int("hidden_size"),), ctx.config)


def dense_mlp(ctx: ExportContext, out: dict[str, HFTensor], layer: int, ffn: int) -> None:
    post_attention_norm(ctx, out, layer)
    swiglu(ctx, out, LAYER.format(layer) + "mlp.", HF_LAYER.format(layer) + "mlp.", ffn)


# --------------------------------------------------------------------------------------
# The Megatron tensors these blocks read (import-hf: the model to write)
# --------------------------------------------------------------------------------------


def embeddings_shapes(cfg: HFConfig, spec: MegatronSpec, shapes: Shapes) -> None:
    shapes[EMBED] = (spec.padded_vocab, cfg.int("hidden_size"))


def output_shapes(cfg: HFConfig, spec: MegatronSpec, shapes: Shapes, tie_default: bool = False) -> None:
    hidden = cfg.int("hidden_size")
    shapes[FINAL_NORM] = (hidden,)
    if not cfg.flag("tie_word_embeddings", tie_default):
        shapes[OUTPUT] = (spec.padded_vocab, hidden)


def attention_shapes(cfg: HFConfig, spec: MegatronSpec, shapes: Shapes, layer: int, att: Attention,
                     qk_norm: bool) -> None:
    """Megatron's fused-norm `linear_qkv` (biases when the HF model has them), `linear_proj`, q/k norms."""
    mg, hf = LAYER.format(layer), HF_LAYER.format(layer) + "self_attn."
    if att.groups % spec.tp:
        raise UsageError(f"{cfg.path}: num_key_value_heads={att.groups} does not divide by TP {spec.tp} "
                         "(Megatron gives each TP rank whole query groups)")
    d = att.head_dim
    rows = att.groups * (att.per_group * d * (2 if att.gated else 1) + 2 * d)
    shapes[mg + INPUT_NORM[0]] = (att.hidden,)
    shapes[mg + "self_attention.linear_qkv.weight"] = (rows, att.hidden)
    if spec.has(hf + "q_proj.bias"):
        shapes[mg + "self_attention.linear_qkv.bias"] = (rows,)
    shapes[mg + O_PROJ[0]] = (att.hidden, att.heads * d)
    if spec.has(hf + "o_proj.bias"):
        shapes[mg + O_PROJ_BIAS[0]] = (att.hidden,)
    if qk_norm:
        shapes[mg + Q_NORM[0]] = (d,)
        shapes[mg + K_NORM[0]] = (d,)


def swiglu_shapes(cfg: HFConfig, spec: MegatronSpec, shapes: Shapes, mg_mlp: str, hf_mlp: str, ffn: int,
                  index: str = "") -> None:
    """fc1 fused `[2·ffn, hidden]` (TP-blocked at the spec's TP) or split `_w`/`_v`, fc2, their biases."""
    hidden = cfg.int("hidden_size")
    for kind, trailing in (("weight", (hidden,)), ("bias", ())):
        if kind == "bias" and not spec.has(hf_mlp + "gate_proj.bias"):
            continue
        base = f"{mg_mlp}linear_fc1.{kind}{index}"
        if spec.split:
            for part in SWIGLU_PARTS:
                shapes[base + part] = (ffn, *trailing)
        else:
            shapes[base] = (2 * ffn, *trailing)
    shapes[f"{mg_mlp}linear_fc2.weight{index}"] = (hidden, ffn)
    if spec.has(hf_mlp + "down_proj.bias"):
        shapes[f"{mg_mlp}linear_fc2.bias{index}"] = (hidden,)


def dense_mlp_shapes(cfg: HFConfig, spec: MegatronSpec, shapes: Shapes, layer: int, ffn: int) -> None:
    shapes[LAYER.format(layer) + POST_ATTENTION_NORM[0]] = (cfg.int("hidden_size"),)
    swiglu_shapes(cfg, spec, shapes, LAYER.format(layer) + "mlp.", HF_LAYER.format(layer) + "mlp.", ffn)


def put(out: dict[str, HFTensor], hf: HFTensor, shape: tuple[int, ...], cfg: HFConfig) -> None:
    if hf.name in out:
        raise CheckpointError(hf.sources[0], f"{hf.name} would be written twice")
    out[hf.name] = check_shape(hf, shape, cfg)


@dataclass(frozen=True)
class DenseFamily:
    """Llama-style dense decoder; the variants differ in defaults and in q/k norms and qkv biases."""

    name: str
    model_types: tuple[str, ...]
    qk_norm: bool
    qkv_bias: bool | None
    head_dim_default: int | None
    kv_heads_default: int | None = None

    def attention(self, cfg: HFConfig) -> Attention:
        data = dict(cfg.data)
        if self.kv_heads_default is not None:
            data.setdefault("num_key_value_heads", self.kv_heads_default)
        return Attention.from_config(HFConfig(cfg.path, data, cfg.folder), self.head_dim_default)

    def to_hf(self, ctx: ExportContext) -> dict[str, HFTensor]:
        cfg = ctx.config
        att = self.attention(cfg)
        bias = self.qkv_bias if self.qkv_bias is not None else (True if cfg.flag("attention_bias") else None)
        out: dict[str, HFTensor] = {}
        embeddings(ctx, out)
        for layer in range(cfg.int("num_hidden_layers")):
            attention(ctx, out, layer, att, self.qk_norm, bias)
            dense_mlp(ctx, out, layer, cfg.int("intermediate_size"))
        output_layer(ctx, out)
        return out

    def megatron_shapes(self, cfg: HFConfig, spec: MegatronSpec) -> Shapes:
        att = self.attention(cfg)
        shapes: Shapes = {}
        embeddings_shapes(cfg, spec, shapes)
        for layer in range(cfg.int("num_hidden_layers")):
            attention_shapes(cfg, spec, shapes, layer, att, self.qk_norm)
            dense_mlp_shapes(cfg, spec, shapes, layer, cfg.int("intermediate_size"))
        output_shapes(cfg, spec, shapes)
        return shapes


LLAMA = DenseFamily("llama", ("llama",), qk_norm=False, qkv_bias=None, head_dim_default=None)
QWEN2 = DenseFamily("qwen2", ("qwen2",), qk_norm=False, qkv_bias=True, head_dim_default=None, kv_heads_default=32)
QWEN3 = DenseFamily("qwen3", ("qwen3",), qk_norm=True, qkv_bias=None, head_dim_default=128, kv_heads_default=32)
