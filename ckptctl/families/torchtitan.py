"""torchtitan models ↔ Hugging Face: llama3, qwen3 (dense, MoE), DeepSeek-V3, as its own adapters map them.

A family is one table of names (torchtitan's `state_dict_adapter.from_hf_map`, `{}` for the
layer), read HF → torchtitan for an export and backwards for an import. torchtitan saves
its model keys at the top of the state dict (no prefix; `optimizer.*`, `lr_scheduler`,
`dataloader`, `train_state` beside them) and, although 0.3 computes q, k and v with one
fused `wqkv`, it saves them split as `qkv_linear.wq/wk/wv` (a state-dict hook).

llama3 alone reorders rows: its RoPE rotates interleaved pairs where HF's rotates halves,
so within each head HF row `j·d/2 + i` is torchtitan row `2i + j` (j = 0, 1; the adapter's
`_permute`) for q_proj and k_proj: the tensor read as row pairs, two transposed pieces per head. Qwen3 rotates as HF does: rows stay. torchtitan saves
`lm_head.weight` even when it ties it to the embeddings; a tied config does not export it (once
export-hf has proven it equal to the embeddings, `base.TiedHead`).

Qwen3's MoE layers (`qwen3_moe` configs) keep the experts stacked: `w1_EFD`, `w3_EFD`
[E, F, D] and `w2_EDF` [E, D, F]; expert e of HF (`mlp.experts.<e>.gate_proj` [F, D] …) is
slab e, rows e·F … of the stack read as [E·F, D]. The router's load-balancing bias
`moe.expert_bias_E` (auxiliary-loss-free balancing, on by default) has no place in HF's
Qwen3-MoE, which routes without one: it is left out only when it is all zeros (or with
`--drop-expert-bias`), else routing would silently change.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, ClassVar

from ckptctl.families.base import (DeinterleavedRows, ExportContext, HFConfig, HFTensor, MegatronModel, RowView, Shapes,
                             TiedHead, is_model_key)
from ckptctl.families.deepseek_v3 import first_k_dense
from ckptctl.families.protocol import Naming, NotMegatron
from ckptctl.families.qwen3_moe import is_sparse
from ckptctl.families.rules import HF_LAYER, Attention, put
from ckptctl.util.errors import CheckpointError
from ckptctl.core.checkpoint import Checkpoint

EMBED = "tok_embeddings.weight"
OUTPUT = "lm_head.weight"
LAYER = "layers.{}."
EXPERT_BIAS = "moe.expert_bias_E"
EXPERT_BIASES = LAYER.format("*") + EXPERT_BIAS
"""Every layer's expert bias, as notes name them."""

GLOBAL_NAMES = {"model.embed_tokens.weight": EMBED, "model.norm.weight": "norm.weight"}
LAYER_NAMES = {  # under model.layers.{L}. ← under layers.{L}.
    "input_layernorm.weight": "attention_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
}
GQA_NAMES = {
    "self_attn.q_proj.weight": "attention.qkv_linear.wq.weight",
    "self_attn.k_proj.weight": "attention.qkv_linear.wk.weight",
    "self_attn.v_proj.weight": "attention.qkv_linear.wv.weight",
    "self_attn.o_proj.weight": "attention.wo.weight",
}
QK_NORM_NAMES = {"self_attn.q_norm.weight": "attention.q_norm.weight",
                 "self_attn.k_norm.weight": "attention.k_norm.weight"}
MLA_NAMES = {  # DeepSeek-V3 multi-head latent attention
    "self_attn.kv_a_proj_with_mqa.weight": "attention.wkv_a.weight",
    "self_attn.kv_a_layernorm.weight": "attention.kv_norm.weight",
    "self_attn.kv_b_proj.weight": "attention.wkv_b.weight",
    "self_attn.o_proj.weight": "attention.wo.weight",
}
MLA_Q_LORA_NAMES = {"self_attn.q_a_proj.weight": "attention.wq_a.weight",
                    "self_attn.q_a_layernorm.weight": "attention.q_norm.weight",
                    "self_attn.q_b_proj.weight": "attention.wq_b.weight"}
MLA_Q_NAMES = {"self_attn.q_proj.weight": "attention.wq.weight"}
DENSE_NAMES = {
    "mlp.gate_proj.weight": "feed_forward.w1.weight",
    "mlp.up_proj.weight": "feed_forward.w3.weight",
    "mlp.down_proj.weight": "feed_forward.w2.weight",
}
ROUTER_NAMES = {"mlp.gate.weight": "moe.router.gate.weight"}
SHARED_EXPERT_NAMES = {
    "mlp.shared_experts.gate_proj.weight": "moe.shared_experts.w1.weight",
    "mlp.shared_experts.up_proj.weight": "moe.shared_experts.w3.weight",
    "mlp.shared_experts.down_proj.weight": "moe.shared_experts.w2.weight",
}
EXPERT_NAMES = {  # under model.layers.{L}.mlp.experts.{e}. ← one slab of the stack under layers.{L}.
    "gate_proj.weight": "moe.routed_experts.inner_experts.w1_EFD",
    "up_proj.weight": "moe.routed_experts.inner_experts.w3_EFD",
    "down_proj.weight": "moe.routed_experts.inner_experts.w2_EDF",
}
PERMUTED = ("self_attn.q_proj.weight", "self_attn.k_proj.weight")


def rope_halves(m: MegatronModel, whole: RowView, heads: int) -> DeinterleavedRows:
    """A whole tensor's rows with each head's reordered from interleaved pairs (torchtitan) to
    halves (HF): the tensor read as row pairs, two transposed pieces per head. A chunk cut on
    a column dim (its rows not contiguous) is refused."""
    d = whole.rows // heads if heads else 0
    if whole.rows != d * heads or d % 2:
        raise CheckpointError(whole.fqn, f"{whole.rows} rows are not {heads} heads of an even head dim (wrong "
                                         "--hf-config?)")
    if m.in_row_groups(whole.fqn, 2) is None:
        raise CheckpointError(whole.fqn, "a chunk is cut across its columns, so its rows cannot be read as RoPE "
                                         "pairs (reshard it to whole-row chunks first)")
    return DeinterleavedRows(whole.fqn, whole.rows, whole.trailing, d)


@dataclass(frozen=True)
class TorchtitanFamily(NotMegatron):
    """A torchtitan decoder: its attention (`gqa` with optional q/k norms and llama3's RoPE row
    order, or DeepSeek-V3's `mla`), which layers are MoE (`sparse`), shared experts, and where
    the router's load-balancing bias goes (`expert_bias`: an HF name, or None for none)."""

    name: str
    model_types: tuple[str, ...]
    """The HF `model_type` values it serves, for a checkpoint named as torchtitan names tensors."""
    attention: str
    qk_norm: bool
    interleaved_rope: bool
    head_dim_default: int | None
    sparse: Callable[[HFConfig, int], bool] = is_sparse
    shared_experts: bool = False
    expert_bias: str | None = None
    naming: ClassVar[Naming] = Naming.TORCHTITAN

    def layer_names(self, cfg: HFConfig, layer: int) -> dict[str, str]:
        """HF name → torchtitan name of one layer's tensors but the stacked experts."""
        if self.attention == "mla":
            attention = {**(MLA_Q_LORA_NAMES if cfg.get("q_lora_rank") else MLA_Q_NAMES), **MLA_NAMES}
        else:
            attention = {**GQA_NAMES, **(QK_NORM_NAMES if self.qk_norm else {})}
        if not self.sparse(cfg, layer):
            return {**attention, **LAYER_NAMES, **DENSE_NAMES}
        shared = SHARED_EXPERT_NAMES if self.shared_experts else {}
        bias = {self.expert_bias: EXPERT_BIAS} if self.expert_bias else {}
        return {**attention, **LAYER_NAMES, **ROUTER_NAMES, **bias, **shared}

    def to_hf(self, ctx: ExportContext) -> dict[str, HFTensor]:
        cfg, m = ctx.config, ctx.model
        expected = self.hf_shapes(cfg)
        heads = self.rope_heads(cfg)
        out: dict[str, HFTensor] = {}
        for hf, tt in GLOBAL_NAMES.items():
            put(out, HFTensor(hf, (m.view(tt),)), expected[hf], cfg)
        for layer in range(cfg.int("num_hidden_layers")):
            for hf, tt in self.layer_names(cfg, layer).items():
                view = m.view(LAYER.format(layer) + tt)
                if hf in heads:
                    view = rope_halves(m, view, heads[hf])
                name = HF_LAYER.format(L=layer) + hf
                put(out, HFTensor(name, (view,)), expected[name], cfg)
            if self.sparse(cfg, layer):
                self.experts(ctx, layer, expected, out)
        if cfg.flag("tie_word_embeddings"):
            if m.has(OUTPUT):
                ctx.tied_heads.append(TiedHead(HFTensor("lm_head.weight", (m.view(OUTPUT),)),
                                               "model.embed_tokens.weight", "tie_word_embeddings"))
        else:
            put(out, HFTensor("lm_head.weight", (m.view(OUTPUT),)), expected["lm_head.weight"], cfg)
        return out

    def rope_heads(self, cfg: HFConfig) -> dict[str, int]:
        """The HF tensors whose rows llama3 reorders for RoPE, with their head counts."""
        if not self.interleaved_rope:
            return {}
        att = Attention.from_config(cfg, self.head_dim_default)
        return {PERMUTED[0]: att.heads, PERMUTED[1]: att.groups}

    def experts(self, ctx: ExportContext, layer: int, expected: dict[str, tuple[int, ...]],
                out: dict[str, HFTensor]) -> None:
        """One MoE layer's experts, each a slab of the stacks; an expert bias HF has no place for is
        left to the caller to prove zero (`ExportContext.zero_only`)."""
        cfg, m = ctx.config, ctx.model
        experts = cfg.int("num_experts")
        for hf, tt in EXPERT_NAMES.items():
            stack = m.stacked(LAYER.format(layer) + tt)
            rows = expected[f"{HF_LAYER.format(L=layer)}mlp.experts.0.{hf}"][0]
            if stack.rows != experts * rows:
                raise CheckpointError(stack.fqn, f"stacks {stack.rows} rows, but the config implies {experts} "
                                                 f"experts of {rows} (num_experts, moe_intermediate_size)")
            for e in range(experts):
                name = f"{HF_LAYER.format(L=layer)}mlp.experts.{e}.{hf}"
                put(out, HFTensor(name, (stack.take(e * rows, rows),)), expected[name], cfg)
        bias = LAYER.format(layer) + EXPERT_BIAS
        if self.expert_bias is None and m.has(bias):
            m.used.add(bias)
            ctx.zero_only.append(m.prefix + bias)

    def hf_shapes(self, cfg: HFConfig) -> dict[str, tuple[int, ...]]:
        """Every HF tensor's shape as the config implies it."""
        hidden, vocab = cfg.int("hidden_size"), cfg.int("vocab_size")
        shapes = {"model.embed_tokens.weight": (vocab, hidden), "model.norm.weight": (hidden,),
                  "lm_head.weight": (vocab, hidden)}
        attention = self.mla_shapes(cfg) if self.attention == "mla" else self.gqa_shapes(cfg)
        for layer in range(cfg.int("num_hidden_layers")):
            hf = HF_LAYER.format(L=layer)
            shapes.update({hf + n: shape for n, shape in attention.items()})
            shapes.update({hf + "input_layernorm.weight": (hidden,), hf + "post_attention_layernorm.weight": (hidden,)})
            if self.sparse(cfg, layer):
                ffn, experts = cfg.int("moe_intermediate_size"), cfg.int("num_experts")
                shapes[hf + "mlp.gate.weight"] = (experts, hidden)
                if self.expert_bias:
                    shapes[hf + self.expert_bias] = (experts,)
                for e in range(experts):
                    shapes.update({f"{hf}mlp.experts.{e}.gate_proj.weight": (ffn, hidden),
                                   f"{hf}mlp.experts.{e}.up_proj.weight": (ffn, hidden),
                                   f"{hf}mlp.experts.{e}.down_proj.weight": (hidden, ffn)})
                if self.shared_experts:
                    shared = ffn * cfg.int("n_shared_experts")
                    shapes.update({hf + "mlp.shared_experts.gate_proj.weight": (shared, hidden),
                                   hf + "mlp.shared_experts.up_proj.weight": (shared, hidden),
                                   hf + "mlp.shared_experts.down_proj.weight": (hidden, shared)})
            else:
                ffn = cfg.int("intermediate_size")
                shapes.update({hf + "mlp.gate_proj.weight": (ffn, hidden), hf + "mlp.up_proj.weight": (ffn, hidden),
                               hf + "mlp.down_proj.weight": (hidden, ffn)})
        return shapes

    def gqa_shapes(self, cfg: HFConfig) -> dict[str, tuple[int, ...]]:
        att = Attention.from_config(cfg, self.head_dim_default)
        hidden, q, kv = att.hidden, att.heads * att.head_dim, att.groups * att.head_dim
        shapes = {"self_attn.q_proj.weight": (q, hidden), "self_attn.k_proj.weight": (kv, hidden),
                  "self_attn.v_proj.weight": (kv, hidden), "self_attn.o_proj.weight": (hidden, q)}
        if self.qk_norm:
            shapes.update({"self_attn.q_norm.weight": (att.head_dim,), "self_attn.k_norm.weight": (att.head_dim,)})
        return shapes

    @staticmethod
    def mla_shapes(cfg: HFConfig) -> dict[str, tuple[int, ...]]:
        """Multi-head latent attention: queries through a low-rank `q_lora_rank` (when set), keys
        and values through `kv_lora_rank` plus the shared RoPE key of `qk_rope_head_dim`."""
        hidden, heads = cfg.int("hidden_size"), cfg.int("num_attention_heads")
        nope, rope, v = cfg.int("qk_nope_head_dim"), cfg.int("qk_rope_head_dim"), cfg.int("v_head_dim")
        kv_lora, q_lora = cfg.int("kv_lora_rank"), cfg.get("q_lora_rank")
        shapes = {"self_attn.kv_a_proj_with_mqa.weight": (kv_lora + rope, hidden),
                  "self_attn.kv_a_layernorm.weight": (kv_lora,),
                  "self_attn.kv_b_proj.weight": (heads * (nope + v), kv_lora),
                  "self_attn.o_proj.weight": (hidden, heads * v)}
        if q_lora:
            q_lora = cfg.int("q_lora_rank")
            shapes.update({"self_attn.q_a_proj.weight": (q_lora, hidden), "self_attn.q_a_layernorm.weight": (q_lora,),
                           "self_attn.q_b_proj.weight": (heads * (nope + rope), q_lora)})
        else:
            shapes["self_attn.q_proj.weight"] = (heads * (nope + rope), hidden)
        return shapes

    def source_shapes(self, cfg: HFConfig) -> Shapes:
        """The torchtitan tensors an import writes (the table read backwards), with their shapes:
        `lm_head.weight` only when not tied (the importer adds a tied one as a copy); expert
        stacks [E, rows, …]; and an expert bias no HF tensor makes (`zero_filled`)."""
        hf_shapes = self.hf_shapes(cfg)
        shapes: Shapes = {tt: hf_shapes[hf] for hf, tt in GLOBAL_NAMES.items()}
        for layer in range(cfg.int("num_hidden_layers")):
            for hf, tt in self.layer_names(cfg, layer).items():
                shapes[LAYER.format(layer) + tt] = hf_shapes[HF_LAYER.format(L=layer) + hf]
            if self.sparse(cfg, layer):
                experts = cfg.int("num_experts")
                for hf, tt in EXPERT_NAMES.items():
                    shapes[LAYER.format(layer) + tt] = (experts,
                                                        *hf_shapes[f"{HF_LAYER.format(L=layer)}mlp.experts.0.{hf}"])
                if self.expert_bias is None:
                    shapes[LAYER.format(layer) + EXPERT_BIAS] = (experts,)
        if not cfg.flag("tie_word_embeddings"):
            shapes[OUTPUT] = hf_shapes["lm_head.weight"]
        return shapes

    def zero_filled(self, name: str) -> bool:
        """Tensors an import writes as zeros: an expert bias the HF model has no place for."""
        return self.expert_bias is None and name.endswith(EXPERT_BIAS)


TORCHTITAN_LLAMA3 = TorchtitanFamily("torchtitan-llama3", ("llama",), "gqa", qk_norm=False, interleaved_rope=True,
                                     head_dim_default=None)
TORCHTITAN_QWEN3 = TorchtitanFamily("torchtitan-qwen3", ("qwen3", "qwen3_moe"), "gqa", qk_norm=True,
                                    interleaved_rope=False, head_dim_default=128)
TORCHTITAN_DEEPSEEK_V3 = TorchtitanFamily("torchtitan-deepseek-v3", ("deepseek_v3",), "mla", qk_norm=False,
                                          interleaved_rope=False, head_dim_default=None, sparse=first_k_dense,
                                          shared_experts=True, expert_bias="mlp.gate.e_score_correction_bias")
TORCHTITAN_FAMILIES = (TORCHTITAN_LLAMA3, TORCHTITAN_QWEN3, TORCHTITAN_DEEPSEEK_V3)


def torchtitan_prefix(ckpt: Checkpoint) -> str | None:
    """What precedes torchtitan's `tok_embeddings.weight` among the model keys ('' as torchtitan
    saves them), or None when the checkpoint is not named as torchtitan names tensors."""
    for fqn in ckpt.tensors:
        if fqn.endswith(EMBED) and is_model_key(fqn):
            prefix = fqn[:-len(EMBED)]
            if prefix == "" or prefix.endswith("."):
                return prefix
    return None
