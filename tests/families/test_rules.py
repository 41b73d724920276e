"""Every Megatron family's rules are a bijection of rows: `from_hf ∘ to_hf` and `to_hf ∘ from_hf` are the identity.

For random head layouts, sizes, TP degrees and fused/split layouts, a family's table gives
the Megatron tensors an import writes (`megatron_shapes`) and, over them, the HF tensors
(`to_hf`); read backwards (`reversed_pieces`) that is the import. Evaluated on random
values in memory, export then import gives back every Megatron tensor (the vocab padding
rows stay zero), and import then export gives back every HF tensor, bit for bit. The
values are multiples of 1/8, so the shifted norms (`+ 1`) are exact both ways.
"""

from __future__ import annotations

from pathlib import Path

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ckptctl.families.base import ExportContext, HFConfig, MegatronSpec, planned_model, reversed_pieces
from ckptctl.families.registry import FAMILIES
from ckptctl.core.plan import Piece

DTYPE = torch.float32


def assemble(shape: tuple[int, ...], pieces: list[Piece], add: float, tensors: dict[str, torch.Tensor],
             views: dict[str, tuple[int, ...]] | None = None) -> torch.Tensor:
    """A tensor from its pieces over whole in-memory sources (`views`: sources read in another shape
    of their elements); rows no piece fills are zero. A transposed piece is the source block with
    its unit dims dropped, permuted as `axes` says, then shaped as the destination block."""
    out = torch.zeros(shape, dtype=DTYPE)
    for p in pieces:
        source = tensors[p.src].reshape((views or {}).get(p.src, tensors[p.src].shape))
        box = p.source_box
        src = source[tuple(slice(s, s + n) for s, n in zip(box.offsets, box.sizes))]
        if p.axes is not None:
            kept = sorted(a for a in p.axes if a is not None)
            src = src.reshape([box.sizes[k] for k in kept]).permute([kept.index(a) for a in p.axes if a is not None])
            src = src.reshape(p.sizes)
        out[tuple(slice(d, d + n) for d, n in zip(p.dst_start, p.sizes))] = src
    return out + add if add else out


def values(shape: tuple[int, ...], generator: torch.Generator) -> torch.Tensor:
    return torch.randint(-4096, 4096, shape, generator=generator).to(DTYPE) / 8


@st.composite
def configs(draw, family: str) -> tuple[dict, int, bool]:
    tp = draw(st.sampled_from([1, 2, 4]))
    groups = tp * draw(st.integers(1, 2))
    head_dim = 2 * draw(st.integers(1, 3))
    cfg = dict(model_type=family, vocab_size=draw(st.integers(3, 40)), hidden_size=draw(st.integers(2, 6)),
               intermediate_size=tp * draw(st.integers(1, 3)), num_hidden_layers=draw(st.integers(1, 3)),
               num_attention_heads=groups * draw(st.integers(1, 2)), num_key_value_heads=groups, head_dim=head_dim,
               tie_word_embeddings=draw(st.booleans()))
    if family == "deepseek_v3":
        cfg.update(num_attention_heads=draw(st.integers(1, 4)), kv_lora_rank=draw(st.integers(1, 6)),
                   qk_nope_head_dim=draw(st.integers(1, 4)), qk_rope_head_dim=draw(st.integers(1, 4)),
                   v_head_dim=draw(st.integers(1, 4)), q_lora_rank=draw(st.sampled_from([None, 3])),
                   n_routed_experts=draw(st.integers(1, 3)), n_shared_experts=draw(st.integers(1, 2)),
                   moe_intermediate_size=tp * draw(st.integers(1, 2)),
                   first_k_dense_replace=draw(st.integers(0, cfg["num_hidden_layers"])),
                   num_nextn_predict_layers=draw(st.integers(0, 2)))
    if family in ("mixtral", "gpt_oss"):
        cfg.update(num_local_experts=draw(st.integers(1, 3)))
    if family == "gpt_oss":
        cfg.update(attention_bias=True)
    if family in ("qwen3_moe", "qwen3_next", "qwen3_5_moe_text"):
        cfg.update(num_experts=draw(st.integers(1, 3)), moe_intermediate_size=tp * draw(st.integers(1, 2)),
                   decoder_sparse_step=draw(st.integers(1, 2)))
    if family in ("qwen3_next", "qwen3_5_moe_text"):
        key_heads = tp * draw(st.integers(1, 2))
        cfg.update(linear_num_key_heads=key_heads, linear_num_value_heads=key_heads * draw(st.integers(1, 2)),
                   linear_key_head_dim=draw(st.integers(1, 3)), linear_value_head_dim=draw(st.integers(1, 3)),
                   linear_conv_kernel_dim=draw(st.integers(1, 4)), shared_expert_intermediate_size=tp,
                   layer_types=[draw(st.sampled_from(["linear_attention", "full_attention"]))
                                for _ in range(cfg["num_hidden_layers"])])
    if family == "nemotron_h":
        cfg.update(mamba_num_heads=tp * draw(st.integers(1, 2)), mamba_head_dim=draw(st.integers(1, 3)),
                   n_groups=tp, ssm_state_size=draw(st.integers(1, 3)), conv_kernel=draw(st.integers(1, 4)),
                   layers_block_type=[draw(st.sampled_from(["linear_attention", "full_attention", "mlp"]))
                                      for _ in range(cfg["num_hidden_layers"])])
    return cfg, tp, draw(st.booleans())


def check_bijection(family_name: str, config: dict, tp: int, split: bool, bias: bool) -> None:
    cfg = HFConfig(Path("/nonexistent/config.json"), config)
    family = FAMILIES[family_name]
    vocab = config["vocab_size"]
    padded = -(-vocab // (8 * tp)) * 8 * tp
    # The HF names present decide the optional biases: take them from an export of the full set.
    mtp = family.mtp_prefixes(cfg)  # an MTP layer is imported where the folder has one: say it has
    probe_spec = MegatronSpec(tp, split, padded, frozenset(p + "eh_proj.weight" for p in mtp))
    probe = family.to_hf(ExportContext(cfg, planned_model(Path("/x"), family.megatron_shapes(cfg, probe_spec), DTYPE),
                                       tp, tp))
    names = set(probe)
    if bias:
        names |= {n.replace(".weight", ".bias") for n in probe if n.endswith(("q_proj.weight", "k_proj.weight",
                                                                               "v_proj.weight", "gate_proj.weight",
                                                                               "up_proj.weight"))}
    spec = MegatronSpec(tp, split, padded, frozenset(names))
    shapes = family.megatron_shapes(cfg, spec)
    model = planned_model(Path("/x"), shapes, DTYPE)
    hf = family.to_hf(ExportContext(cfg, model, tp, tp))
    assert model.unused() == []
    assert set(hf) == names
    pieces, adds = reversed_pieces(hf, shapes)
    gen = torch.Generator().manual_seed(0)

    megatron = {}
    for name, shape in shapes.items():
        megatron[name] = values(shape, gen)
        if name.endswith(("word_embeddings.weight", "output_layer.weight")):
            megatron[name][vocab:] = 0  # padding rows: no HF row, so an import writes zeros
    logical = {n: t.logical_shape for n, t in hf.items() if getattr(t, "logical_shape", None)}
    exported = {n: assemble(logical.get(n, t.shape), list(t.pieces()), t.add, megatron).reshape(t.shape)
                for n, t in hf.items()}
    imported = {n: assemble(shapes[n], pieces[n], adds.get(n, 0.0), exported, logical) for n in shapes}
    for name in shapes:
        assert torch.equal(imported[name], megatron[name]), name

    source = {n: values(t.shape, gen) for n, t in hf.items()}
    back = {n: assemble(shapes[n], pieces[n], adds.get(n, 0.0), source, logical) for n in shapes}
    again = {n: assemble(logical.get(n, t.shape), list(t.pieces()), t.add, back).reshape(t.shape)
             for n, t in hf.items()}
    for name in hf:
        assert torch.equal(again[name], source[name]), name


@settings(max_examples=40, deadline=None)
@given(data=st.data(), family=st.sampled_from(["llama", "qwen2", "qwen3", "gemma2", "gemma3"]), bias=st.booleans())
def test_dense_family_rules_are_a_bijection(data, family, bias):
    config, tp, split = data.draw(configs({"gemma3": "gemma3_text"}.get(family, family)))
    check_bijection(family, config, tp, split, bias or family == "qwen2")


@settings(max_examples=25, deadline=None)
@given(data=st.data(), family=st.sampled_from(["qwen3-moe", "qwen3-next", "qwen3.5", "deepseek-v3", "mixtral",
                                                              "nemotron-h", "gpt-oss"]))
def test_moe_gated_deltanet_and_latent_attention_family_rules_are_a_bijection(data, family):
    config, tp, split = data.draw(configs({"qwen3.5": "qwen3_5_moe_text"}.get(family, family.replace("-", "_"))))
    check_bijection(family, config, tp, split, bias=False)
