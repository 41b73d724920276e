"""export-hf name tables and split maps, checked in memory: no disk, no ranks.

Every family is round-tripped through its test-side inverse (`fixtures.hf_models.to_megatron`):
ckptctl's pieces, evaluated on the in-memory Megatron tensors, must give back every tensor
of the HF checkpoint `save_pretrained` wrote, bit for bit, at every TP size and layout.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
import torch

from ckptctl.util.errors import CheckpointError, IncompleteCheckpointError, UsageError
from ckptctl.commands.export_hf import ExportOptions, choose_family, plan_export
from ckptctl.formats.safetensors.writer import item_boxes, placed_file
from ckptctl.families.registry import FAMILIES
from ckptctl.families.base import ExportContext, HFConfig, MegatronModel, RowView, megatron_prefix
from ckptctl.families.rules import Attention, qkv_views
from ckptctl.families.qwen3_next import layer_types
from ckptctl.megatron.rows import RowBlock, select_rows, tp_blocked_split
from ckptctl.core.checkpoint import Checkpoint, Chunk, TensorEntry
from ckptctl.core.plan import TargetTensor, missing_elements, plan_box, source_view
from fixtures import hf_models


def fake_checkpoint(tensors: dict[str, torch.Tensor], prefix: str = "model.module.") -> Checkpoint:
    """Metadata only: each tensor saved as two uneven whole-row chunks (the first may be empty)."""
    entries = {}
    for i, (name, t) in enumerate(sorted(tensors.items())):
        fqn = prefix + name
        rows = t.shape[0] if t.dim() else 0
        cut = (i * 7) % (rows + 1) if rows else 0
        chunks = [Chunk("__0_0.distcp", 0, 1, (0, *[0] * (t.dim() - 1)), (cut, *t.shape[1:])),
                  Chunk("__1_0.distcp", 0, 1, (cut, *[0] * (t.dim() - 1)), (rows - cut, *t.shape[1:]))]
        entries[fqn] = TensorEntry(fqn, tuple(t.shape), t.dtype, tuple(c for c in chunks if c.numel))
    return Checkpoint(path=Path("/nonexistent/ckpt"), tensors=entries, bytes_entries={}, files={})


def evaluate(target: TargetTensor, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
    """A target's values from full in-memory sources, piece by piece: pieces address its logical
    shape (row pairs, gpt-oss's interleaved gate/up), a transposed piece's block is turned as its
    `axes` say (destination dim i along source dim axes[i]; None a unit dim the source lacks)."""
    out = torch.full(target.logical_shape or target.shape, float("nan"), dtype=target.dtype.torch)
    for p in target.pieces:
        box = p.source_box
        src = tensors[p.src][tuple(slice(s, s + n) for s, n in zip(box.offsets, box.sizes))]
        if p.axes is not None:
            used = [a for a in p.axes if a is not None]
            src = src.permute(*used, *(d for d in range(src.dim()) if d not in used)).reshape(
                [src.shape[a] for a in used])
            for i, a in enumerate(p.axes):
                if a is None:
                    src = src.unsqueeze(i)
        out[tuple(slice(d, d + n) for d, n in zip(p.dst_start, p.sizes))] = src
    out = out.reshape(target.shape)
    return out + target.add if target.add else out


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    return {f: hf_models.reference(f, tmp_path_factory.mktemp(f)) for f in hf_models.ARCH}


def roundtrip(ref, tp: int, fc1: str, gdn: str) -> None:
    state = hf_models.to_megatron(ref, tp, fc1, gdn)
    tensors = {"model.module." + k: t for k, (t, _) in state.items()}
    ckpt = fake_checkpoint({k: t for k, (t, _) in state.items()})
    cfg = HFConfig(ref.folder / "config.json", json.loads((ref.folder / "config.json").read_text()), ref.folder)
    model = MegatronModel(ckpt, "model.module.")
    out = FAMILIES[hf_models.ARCH[ref.family]].to_hf(ExportContext(cfg, model, tp_value=tp))
    assert model.unused() == []
    assert sorted(out) == sorted(ref.state)
    sources = {fqn: source_view(e) for fqn, e in ckpt.tensors.items()}
    for name, hf in out.items():
        target = hf.target(torch.float32)
        assert torch.equal(evaluate(target, tensors), ref.state[name]), name
        box = item_boxes(target.shape, 4)[0]
        assert missing_elements(box, plan_box(target, box, sources)) == 0, name


DEFAULT_MAPS = [("llama", 2, "fused", "fused"), ("llama", 1, "split", "split"), ("qwen3", 2, "fused", "fused"),
                ("qwen2", 2, "fused", "fused"), ("llama-bias", 4, "fused", "fused"), ("llama-bias", 2, "split", "split"),
                ("qwen3-moe", 4, "fused", "fused"), ("qwen3-next", 2, "fused", "fused"),
                ("qwen3-next", 4, "split", "split")]
ALL_MAPS = [(f, tp, fc1, gdn) for f in hf_models.ARCH for tp in (1, 2, 4) if tp <= hf_models.MAX_TP[f]
            for fc1 in ("fused", "split") for gdn in (("fused", "split") if f == "qwen3-next" else ("fused",))]


@pytest.mark.parametrize("family,tp,fc1,gdn", DEFAULT_MAPS, ids=lambda v: str(v))
def test_family_maps_invert_the_megatron_layout(references, family, tp, fc1, gdn):
    roundtrip(references[family], tp, fc1, gdn)


@pytest.mark.full
@pytest.mark.parametrize("family,tp,fc1,gdn", [c for c in ALL_MAPS if c not in DEFAULT_MAPS], ids=lambda v: str(v))
def test_family_maps_invert_the_megatron_layout_everywhere(references, family, tp, fc1, gdn):
    roundtrip(references[family], tp, fc1, gdn)


def test_select_rows_rebases_a_slice_of_a_tp_blocked_component():
    w, v = tp_blocked_split([6, 6], 2)  # fused rows: W0 0-2, V0 3-5, W1 6-8, V1 9-11
    assert select_rows(v, 2, 3) == [RowBlock(5, 0, 1), RowBlock(9, 1, 2)]
    assert select_rows(w, 0, 6) == [RowBlock(0, 0, 3), RowBlock(6, 3, 3)]


def test_qkv_views_follow_query_groups():
    att = Attention(heads=4, groups=2, head_dim=1, hidden=1)
    view = RowView("qkv", 8, (), (RowBlock(0, 0, 8),))
    q, k, v = qkv_views(view, att)
    rows = lambda views: [b.src_row + i for x in views for b in x.blocks for i in range(b.rows)]  # noqa: E731
    assert (rows(q), rows(k), rows(v)) == ([0, 1, 4, 5], [2, 6], [3, 7])


def test_gated_qkv_interleaves_query_and_gate_per_head():
    att = Attention(heads=4, groups=2, head_dim=1, hidden=1, gated=True)
    view = RowView("qkv", 12, (), (RowBlock(0, 0, 12),))
    q, k, v = qkv_views(view, att)
    rows = lambda views: [b.src_row + i for x in views for b in x.blocks for i in range(b.rows)]  # noqa: E731
    # group g rows: [q_g0, q_g1, gate_g0, gate_g1, k_g, v_g]
    assert rows(q) == [0, 2, 1, 3, 6, 8, 7, 9]
    assert (rows(k), rows(v)) == ([4, 10], [5, 11])


def test_gdn_norm_is_shifted_by_one_and_other_norms_are_copied(references):
    ref = references["qwen3-next"]
    state = hf_models.to_megatron(ref, 1)
    ckpt = fake_checkpoint({k: t for k, (t, _) in state.items()})
    cfg = HFConfig(ref.folder / "config.json", json.loads((ref.folder / "config.json").read_text()), ref.folder)
    out = FAMILIES["qwen3-next"].to_hf(ExportContext(cfg, MegatronModel(ckpt, "model.module."), tp_value=1))
    shifted = {n for n, t in out.items() if t.add}
    assert shifted == {f"model.layers.{i}.linear_attn.norm.weight" for i in (0, 2)}


def test_layer_types_default_from_full_attention_interval():
    cfg = HFConfig(Path("c.json"), {"num_hidden_layers": 8, "full_attention_interval": 4})
    assert layer_types(cfg) == (["linear_attention"] * 3 + ["full_attention"]) * 2


@pytest.mark.parametrize("prefix", ["model.module.module.", "model.module.", "model.", ""])
def test_megatron_prefix_is_detected(prefix):
    ckpt = fake_checkpoint({"embedding.word_embeddings.weight": torch.zeros(4, 2),
                            "decoder.final_layernorm.weight": torch.zeros(2)}, prefix)
    extra = fake_checkpoint({"optimizer.state.module.decoder.layers.0.x": torch.zeros(2)}, "")
    ckpt.tensors.update(extra.tensors)
    assert megatron_prefix(ckpt) == prefix


def test_auto_arch_uses_model_type_and_falls_back_to_raw_for_hf_names():
    cfg = HFConfig(Path("config.json"), {"model_type": "qwen3_next"})
    meg = fake_checkpoint({"decoder.layers.0.self_attention.in_proj.weight": torch.zeros(4, 2)})
    assert choose_family(meg, cfg, "auto")[0].name == "qwen3-next"
    hf = fake_checkpoint({"model.embed_tokens.weight": torch.zeros(4, 2), "lm_head.weight": torch.zeros(4, 2)},
                         "model.")
    family, prefix = choose_family(hf, cfg, "auto")
    assert (family.name, prefix) == ("raw", "model.")
    with pytest.raises(UsageError, match="model_type 'gpt2' is not one export-hf knows"):
        choose_family(meg, HFConfig(Path("config.json"), {"model_type": "gpt2"}), "auto")


def test_tensors_the_config_has_no_place_for_are_refused(references):
    ref = references["llama"]
    state = {k: t for k, (t, _) in hf_models.to_megatron(ref, 1, "split").items()}
    state["decoder.layers.2.mlp.linear_fc2.weight"] = torch.zeros(32, 48)
    cfg = HFConfig(ref.folder / "config.json", json.loads((ref.folder / "config.json").read_text()), ref.folder)
    with pytest.raises(CheckpointError, match=r"1 model tensors have no place in a llama model of config.json: "
                                              r"model.module.decoder.layers.2.mlp.linear_fc2.weight"):
        plan_export(fake_checkpoint(state), cfg, ExportOptions())


def test_wrong_head_layout_is_refused_with_the_config_named(references):
    ref = references["llama"]
    state = {k: t for k, (t, _) in hf_models.to_megatron(ref, 1, "split").items()}
    data = json.loads((ref.folder / "config.json").read_text())
    data["num_key_value_heads"] = 2
    with pytest.raises(CheckpointError, match="query groups"):
        plan_export(fake_checkpoint(state), HFConfig(ref.folder / "config.json", data), ExportOptions())


def test_shards_follow_huggingface_hub_and_tied_embeddings_are_written_once(references):
    ref = references["qwen3"]
    state = {k: t for k, (t, _) in hf_models.to_megatron(ref, 1, "split").items()}
    cfg = HFConfig(ref.folder / "config.json", json.loads((ref.folder / "config.json").read_text()), ref.folder)
    plan = plan_export(fake_checkpoint(state), cfg, ExportOptions(max_shard_size="20KB"))
    assert len(plan.files) > 1
    assert [f.name for f in plan.files] == [f"model-{i:05d}-of-{len(plan.files):05d}.safetensors"
                                            for i in range(1, len(plan.files) + 1)]
    assert "lm_head.weight" not in plan.targets and sorted(plan.weight_map) == sorted(plan.targets)
    assert plan.parameters == sum(t.numel() for t in ref.state.values())
    assert all(f.size - len(f.header) <= 20_000 or len(plan.file_targets[f.name]) == 1 for f in plan.files)
    assert [p.name for p in plan.ref_files] == ["generation_config.json", "special_tokens_map.json",
                                                "tokenizer_config.json"]


def test_safetensors_header_is_aligned_contiguous_and_in_the_writers_order():
    targets = [TargetTensor("b", (3, 1), torch.bfloat16, ()), TargetTensor("a", (5,), torch.float32, ()),
               TargetTensor("e", (0, 4), torch.float32, ()), TargetTensor("c", (2,), torch.int64, ())]
    f = placed_file("model.safetensors", targets)
    (n,) = struct.unpack("<Q", f.header[:8])
    assert len(f.header) == 8 + n and n % 8 == 0
    header = json.loads(f.header[8:])
    assert list(header) == ["__metadata__", "c", "a", "e", "b"]  # widest dtype first, then by name
    assert header["__metadata__"] == {"format": "pt"}
    assert [header[k]["data_offsets"] for k in "caeb"] == [[0, 16], [16, 36], [36, 36], [36, 42]]
    assert (header["b"]["dtype"], f.offsets["b"], f.size) == ("BF16", len(f.header) + 36, len(f.header) + 42)
    assert list(f.offsets) == ["c", "a", "e", "b"]


def test_header_is_byte_for_byte_the_one_safetensors_writes(tmp_path):
    from safetensors.torch import save_file

    tensors = {"z.bf16": torch.ones(3, dtype=torch.bfloat16), "a.bool": torch.ones(1, dtype=torch.bool),
               "m.fp32": torch.ones(2, 2), "b.fp16": torch.ones(5, dtype=torch.float16),
               "q.i64": torch.ones(1, dtype=torch.int64), "c.u8": torch.ones(7, dtype=torch.uint8),
               "d.fp32": torch.ones(0, 3), "k.i32": torch.ones(3, dtype=torch.int32)}
    save_file(tensors, tmp_path / "ref.safetensors", metadata={"format": "pt"})
    data = (tmp_path / "ref.safetensors").read_bytes()
    f = placed_file("x.safetensors", [TargetTensor(k, tuple(t.shape), t.dtype, ()) for k, t in tensors.items()])
    assert f.header == data[:len(f.header)] and f.size == len(data)


def test_rows_missing_from_every_chunk_are_refused_before_writing(references):
    ref = references["llama"]
    state = {k: t for k, (t, _) in hf_models.to_megatron(ref, 1, "split").items()}
    ckpt = fake_checkpoint(state)
    fqn = "model.module.decoder.layers.1.mlp.linear_fc2.weight"
    entry = ckpt.tensors[fqn]
    ckpt.tensors[fqn] = TensorEntry(fqn, entry.shape, entry.dtype, entry.chunks[:-1])
    cfg = HFConfig(ref.folder / "config.json", json.loads((ref.folder / "config.json").read_text()), ref.folder)
    with pytest.raises(IncompleteCheckpointError, match=r"model.layers.1.mlp.down_proj.weight: \d+ elements of "
                                                       r"model.module.decoder.layers.1.mlp.linear_fc2.weight rows"):
        plan_export(ckpt, cfg, ExportOptions())
