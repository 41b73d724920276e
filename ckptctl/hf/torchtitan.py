"""torchtitan models ↔ Hugging Face: llama3, qwen3 and qwen3-moe, as torchtitan's own adapters map them.

A family is one table of names (torchtitan's `state_dict_adapter.from_hf_map`, `{}` for the
layer), read HF → torchtitan for an export and backwards for an import. torchtitan saves
its model keys at the top of the state dict (no prefix; `optimizer.*`, `lr_scheduler`,
`dataloader`, `train_state` beside them) and, although 0.3 computes q, k and v with one
fused `wqkv`, it saves them split as `qkv_linear.wq/wk/wv` (a state-dict hook).

llama3 alone reorders rows: its RoPE rotates interleaved pairs where HF's rotates halves,
so within each head HF row `j·d/2 + i` is torchtitan row `2i + j` (j = 0, 1; the adapter's
`_permute`) for q_proj and k_proj. Qwen3 rotates as HF does: rows stay. torchtitan saves
`lm_head.weight` even when it ties it to the embeddings; a tied config does not export it.

Qwen3's MoE layers (`qwen3_moe` configs) keep the experts stacked: `w1_EFD`, `w3_EFD`
[E, F, D] and `w2_EDF` [E, D, F]; expert e of HF (`mlp.experts.<e>.gate_proj` [F, D] …) is
slab e, rows e·F … of the stack read as [E·F, D]. The router's load-balancing bias
`moe.expert_bias_E` (auxiliary-loss-free balancing, on by default) has no place in HF's
Qwen3-MoE, which routes without one: it is left out only when it is all zeros (or with
`--drop-expert-bias`), else routing would silently change.
"""

from __future__ import annotations

from dataclasses import dataclass

from ckptctl.hf.base import ExportContext, HFConfig, HFTensor, RowView, Shapes, is_model_key
from ckptctl.hf.qwen3_moe import is_sparse
from ckptctl.hf.rules import HF_LAYER, Attention, put
from ckptctl.errors import CheckpointError
from ckptctl.megatron import RowBlock
from ckptctl.model import Checkpoint

EMBED = "tok_embeddings.weight"
OUTPUT = "lm_head.weight"
LAYER = "layers.{}."
EXPERT_BIAS = "moe.expert_bias_E"

GLOBAL_NAMES = {"model.embed_tokens.weight": EMBED, "model.norm.weight": "norm.weight"}
LAYER_NAMES = {  # under model.layers.{L}. ← under layers.{L}.
    "self_attn.q_proj.weight": "attention.qkv_linear.wq.weight",
    "self_attn.k_proj.weight": "attention.qkv_linear.wk.weight",
    "self_attn.v_proj.weight": "attention.qkv_linear.wv.weight",
    "self_attn.o_proj.weight": "attention.wo.weight",
    "input_layernorm.weight": "attention_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
}
DENSE_NAMES = {
    "mlp.gate_proj.weight": "feed_forward.w1.weight",
    "mlp.up_proj.weight": "feed_forward.w3.weight",
    "mlp.down_proj.weight": "feed_forward.w2.weight",
}
QK_NORM_NAMES = {"self_attn.q_norm.weight": "attention.q_norm.weight",
                 "self_attn.k_norm.weight": "attention.k_norm.weight"}
ROUTER_NAMES = {"mlp.gate.weight": "moe.router.gate.weight"}
EXPERT_NAMES = {  # under model.layers.{L}.mlp.experts.{e}. ← one slab of the stack under layers.{L}.
    "gate_proj.weight": "moe.routed_experts.inner_experts.w1_EFD",
    "up_proj.weight": "moe.routed_experts.inner_experts.w3_EFD",
    "down_proj.weight": "moe.routed_experts.inner_experts.w2_EDF",
}
PERMUTED = ("self_attn.q_proj.weight", "self_attn.k_proj.weight")


def rope_halves(whole: RowView, heads: int) -> RowView:
    """A whole tensor's rows with each head's reordered from interleaved pairs (torchtitan) to
    halves (HF): one block per row (a strided view would plan fewer pieces)."""
    d = whole.rows // heads
    blocks = tuple(RowBlock(h * d + 2 * i + j, h * d + j * (d // 2) + i, 1)
                   for h in range(heads) for j in (0, 1) for i in range(d // 2))
    return RowView(whole.fqn, whole.rows, whole.trailing, blocks)


@dataclass(frozen=True)
class TorchtitanFamily:
    """A torchtitan decoder: its name table, q/k norms, RoPE row order, config defaults, MoE layers."""

    name: str
    serves: tuple[str, ...]
    """The HF `model_type` values it serves, for a checkpoint named as torchtitan names tensors."""
    qk_norm: bool
    interleaved_rope: bool
    head_dim_default: int | None

    model_types: tuple[str, ...] = ()
    """None: a config's model_type picks a Megatron family unless the names are torchtitan's."""

    def layer_names(self, cfg: HFConfig, layer: int) -> dict[str, str]:
        """HF name → torchtitan name of one layer's tensors but the stacked experts."""
        mlp = ROUTER_NAMES if is_sparse(cfg, layer) else DENSE_NAMES
        return {**LAYER_NAMES, **(QK_NORM_NAMES if self.qk_norm else {}), **mlp}

    def to_hf(self, ctx: ExportContext) -> dict[str, HFTensor]:
        cfg, m = ctx.config, ctx.model
        att = Attention.from_config(cfg, self.head_dim_default)
        expected = self.hf_shapes(cfg, att)
        out: dict[str, HFTensor] = {}
        for hf, tt in GLOBAL_NAMES.items():
            put(out, HFTensor(hf, (m.view(tt),)), expected[hf], cfg)
        for layer in range(cfg.int("num_hidden_layers")):
            for hf, tt in self.layer_names(cfg, layer).items():
                view = m.view(LAYER.format(layer) + tt)
                if self.interleaved_rope and hf in PERMUTED:
                    view = rope_halves(view, att.heads if hf.startswith("self_attn.q") else att.groups)
                name = HF_LAYER.format(L=layer) + hf
                put(out, HFTensor(name, (view,)), expected[name], cfg)
            if is_sparse(cfg, layer):
                self.experts(ctx, layer, expected, out)
        if cfg.flag("tie_word_embeddings"):
            if m.has(OUTPUT):
                m.used.add(OUTPUT)
                ctx.notes.append(f"{m.prefix}{OUTPUT} not exported: the config ties lm_head to the embeddings")
        else:
            put(out, HFTensor("lm_head.weight", (m.view(OUTPUT),)), expected["lm_head.weight"], cfg)
        return out

    def experts(self, ctx: ExportContext, layer: int, expected: dict[str, tuple[int, ...]],
                out: dict[str, HFTensor]) -> None:
        """One MoE layer's experts, each a slab of the stacks; the expert bias left to the caller to
        prove zero (`ExportContext.zero_only`)."""
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
        if m.has(bias):
            m.used.add(bias)
            ctx.zero_only.append(m.prefix + bias)

    def hf_shapes(self, cfg: HFConfig, att: Attention) -> dict[str, tuple[int, ...]]:
        """Every HF tensor's shape as the config implies it."""
        hidden, vocab = cfg.int("hidden_size"), cfg.int("vocab_size")
        q, kv = att.heads * att.head_dim, att.groups * att.head_dim
        per_layer = {"self_attn.q_proj.weight": (q, hidden), "self_attn.k_proj.weight": (kv, hidden),
                     "self_attn.v_proj.weight": (kv, hidden), "self_attn.o_proj.weight": (hidden, q),
                     "input_layernorm.weight": (hidden,), "post_attention_layernorm.weight": (hidden,),
                     "self_attn.q_norm.weight": (att.head_dim,), "self_attn.k_norm.weight": (att.head_dim,)}
        shapes = {"model.embed_tokens.weight": (vocab, hidden), "model.norm.weight": (hidden,),
                  "lm_head.weight": (vocab, hidden)}
        for layer in range(cfg.int("num_hidden_layers")):
            hf = HF_LAYER.format(L=layer)
            if is_sparse(cfg, layer):
                ffn, experts = cfg.int("moe_intermediate_size"), cfg.int("num_experts")
                shapes[hf + "mlp.gate.weight"] = (experts, hidden)
                for e in range(experts):
                    shapes.update({f"{hf}mlp.experts.{e}.gate_proj.weight": (ffn, hidden),
                                   f"{hf}mlp.experts.{e}.up_proj.weight": (ffn, hidden),
                                   f"{hf}mlp.experts.{e}.down_proj.weight": (hidden, ffn)})
            else:
                ffn = cfg.int("intermediate_size")
                shapes.update({hf + "mlp.gate_proj.weight": (ffn, hidden), hf + "mlp.up_proj.weight": (ffn, hidden),
                               hf + "mlp.down_proj.weight": (hidden, ffn)})
            shapes.update({hf + n: per_layer[n] for n in (*LAYER_NAMES, *(QK_NORM_NAMES if self.qk_norm else ()))})
        return shapes

    def source_shapes(self, cfg: HFConfig) -> Shapes:
        """The torchtitan tensors an import writes (the table read backwards), with their shapes:
        `lm_head.weight` only when not tied (the importer adds a tied one as a copy); expert
        stacks [E, rows, …]; and each MoE layer's `moe.expert_bias_E`, which no HF tensor makes
        (`zero_filled`)."""
        att = Attention.from_config(cfg, self.head_dim_default)
        hf_shapes = self.hf_shapes(cfg, att)
        shapes: Shapes = {tt: hf_shapes[hf] for hf, tt in GLOBAL_NAMES.items()}
        for layer in range(cfg.int("num_hidden_layers")):
            for hf, tt in self.layer_names(cfg, layer).items():
                shapes[LAYER.format(layer) + tt] = hf_shapes[HF_LAYER.format(L=layer) + hf]
            if is_sparse(cfg, layer):
                experts = cfg.int("num_experts")
                for hf, tt in EXPERT_NAMES.items():
                    shapes[LAYER.format(layer) + tt] = (experts,
                                                        *hf_shapes[f"{HF_LAYER.format(L=layer)}mlp.experts.0.{hf}"])
                shapes[LAYER.format(layer) + EXPERT_BIAS] = (experts,)
        if not cfg.flag("tie_word_embeddings"):
            shapes[OUTPUT] = hf_shapes["lm_head.weight"]
        return shapes

    @staticmethod
    def zero_filled(name: str) -> bool:
        """Tensors an import writes as zeros: torchtitan's expert bias (HF routes without one)."""
        return name.endswith(EXPERT_BIAS)


TORCHTITAN_LLAMA3 = TorchtitanFamily("torchtitan-llama3", ("llama",), qk_norm=False, interleaved_rope=True,
                                     head_dim_default=None)
TORCHTITAN_QWEN3 = TorchtitanFamily("torchtitan-qwen3", ("qwen3", "qwen3_moe"), qk_norm=True, interleaved_rope=False,
                                    head_dim_default=128)
TORCHTITAN_FAMILIES = (TORCHTITAN_LLAMA3, TORCHTITAN_QWEN3)


def torchtitan_prefix(ckpt: Checkpoint) -> str | None:
    """What precedes torchtitan's `tok_embeddings.weight` among the model keys ('' as torchtitan
    saves them), or None when the checkpoint is not named as torchtitan names tensors."""
    for fqn in ckpt.tensors:
        if fqn.endswith(EMBED) and is_model_key(fqn):
            prefix = fqn[:-len(EMBED)]
            if prefix == "" or prefix.endswith("."):
                return prefix
    return None


def torchtitan_family(model_type: str) -> TorchtitanFamily | None:
    return next((f for f in TORCHTITAN_FAMILIES if model_type in f.serves), None)
