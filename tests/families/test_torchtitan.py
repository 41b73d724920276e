"""torchtitan checkpoints both ways, against torchtitan's own code.

Tiny llama3, qwen3 (tied), qwen3 MoE and DeepSeek-V3 models are built by torchtitan's layer
builders, sharded with FSDP2 over 2 gloo ranks and saved by torchtitan's own
`CheckpointManager` after an AdamW step (`fixtures.torchtitan_models`). export-hf must give
exactly what torchtitan's own `state_dict_adapter.to_hf` gives (llama3's RoPE row order
included) and a folder transformers loads whole; import-hf `--to torchtitan` of that folder
must load, through torchtitan's checkpoint manager (a model-only `initial_load_path`), into a
model with other weights and make it equal the saved one.
Skipped without torchtitan (`make install` puts it in the dev environment).
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from ckptctl.formats.dcp.metadata import open_checkpoint
from fixtures import torchtitan_models as titan
from fixtures.gloo import run_ranks
from tests.conftest import run_cli

pytestmark = pytest.mark.skipif(not titan.available(), reason="torchtitan is not installed")
transformers = pytest.importorskip("transformers")
FAMILIES = ("llama3", "qwen3", "qwen3-moe", "deepseek-v3")
ARCH = {"llama3": "torchtitan-llama3", "qwen3": "torchtitan-qwen3", "qwen3-moe": "torchtitan-qwen3",
        "deepseek-v3": "torchtitan-deepseek-v3"}
WORLD = 2
BIASED = "qwen3-moe-biased"
"""A Qwen3-MoE saved with a trained (non-zero) expert bias, beside the families."""


@pytest.fixture(scope="session")
def runs(tmp_path_factory):
    """Every family and the biased Qwen3-MoE, saved by torchtitan in one set of ranks: their folder
    and each one's full model state."""
    root = tmp_path_factory.mktemp("torchtitan")
    jobs = (*((family, family, 0.0) for family in FAMILIES), (BIASED, "qwen3-moe", 0.25))
    return root, run_ranks(titan.save_families, WORLD, jobs, str(root), timeout=240)[0]


@pytest.fixture(scope="session")
def saved(runs):
    """Per family: the checkpoint torchtitan saved, its full model state, and the HF config folder."""
    root, states = runs
    out = {}
    for family in FAMILIES:
        state = states[family]
        ckpt = root / family / titan.SAVED
        ref = root / f"{family}-ref"
        ref.mkdir()
        (ref / "config.json").write_text(json.dumps(titan.hf_config(family)))
        out[family] = (ckpt, state, ref)
    return out


@pytest.fixture(scope="session")
def exported(saved, tmp_path_factory):
    root = tmp_path_factory.mktemp("torchtitan-hf")

    def export(item):
        family, (ckpt, _, ref) = item
        run = run_cli("export-hf", ckpt, root / family, "--hf-config", ref, "--verify")
        assert run.returncode == 0, run.stderr
        return family, (root / family, run)

    with ThreadPoolExecutor(max_workers=2) as pool:  # each run is a process: two cores, two at a time
        return dict(pool.map(export, saved.items()))


def _folder(path):
    from safetensors.torch import load_file

    return load_file(path / "model.safetensors")


@pytest.mark.parametrize("family", FAMILIES)
def test_export_equals_torchtitans_own_adapter_bit_exactly(saved, exported, family):
    _, state, _ = saved[family]
    folder, run = exported[family]
    want = titan.to_hf(family, state)
    got = _folder(folder)
    assert sorted(got) == sorted(want)
    for name, tensor in want.items():
        assert torch.equal(got[name], tensor), name
    assert f"({ARCH[family]}, {len(want)} tensors in 1 safetensors file" in run.stderr


def in_memory(want: dict[str, torch.Tensor], name: str) -> torch.Tensor:
    """What transformers 5 holds for `name`: a tied lm_head is the embeddings; MoE experts are
    stacked per layer, `gate_up_proj` [E, 2F, H] (gate then up) and `down_proj` [E, H, F]."""
    if name == "lm_head.weight" and name not in want:
        return want["model.embed_tokens.weight"]
    for stacked, parts in (("mlp.experts.gate_up_proj", ("gate_proj", "up_proj")),
                           ("mlp.experts.down_proj", ("down_proj",))):
        if name.endswith(stacked):
            layer = name[: -len(stacked)]
            experts = sorted({int(k[len(layer):].split(".")[2]) for k in want if k.startswith(layer + "mlp.experts.")})
            return torch.stack([torch.cat([want[f"{layer}mlp.experts.{e}.{p}.weight"] for p in parts]) for e in experts])
    return want[name]


@pytest.mark.parametrize("family", FAMILIES)
def test_transformers_loads_the_export_whole(saved, exported, family):
    folder, _ = exported[family]
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    want = titan.to_hf(family, saved[family][1])
    state = model.state_dict()
    for name, tensor in state.items():
        assert torch.equal(tensor, in_memory(want, name)), name


def test_llama3_q_and_k_rows_are_reordered_and_qwen3s_are_not(saved, exported):
    for family, moved in (("llama3", True), ("qwen3", False)):
        _, state, _ = saved[family]
        q = _folder(exported[family][0])["model.layers.0.self_attn.q_proj.weight"]
        same = torch.equal(q, state["layers.0.attention.qkv_linear.wq.weight"])
        assert same is not moved, family


def test_llama3_rope_rows_plan_as_two_transposed_pieces_per_head(saved):
    """torchtitan saves wq and wk whole: read as row pairs, each head's half is one strided piece."""
    from ckptctl.commands.export_hf import ExportOptions, plan_export
    from ckptctl.formats.dcp.metadata import open_checkpoint
    from ckptctl.families.base import load_hf_config

    ckpt, _, ref = saved["llama3"]
    plan = plan_export(open_checkpoint(ckpt), load_hf_config(ref), ExportOptions())
    for name, heads in (("q_proj", 4), ("k_proj", 2)):
        pieces = plan.targets[f"model.layers.1.self_attn.{name}.weight"].pieces
        assert [(p.src_start, p.dst_start, p.sizes, p.axes) for p in pieces[:2]] == [
            ((0, 0, 0), (0, 0), (8, 64), (0, 2)), ((0, 1, 0), (8, 0), (8, 64), (0, 2))]
        assert len(pieces) == 2 * heads


def test_llama3_rope_rows_import_as_two_transposed_pieces_per_head(exported):
    """Backwards: torchtitan's wq is written as row pairs [32, 2, 64] from two strided pieces per head."""
    from ckptctl.commands.import_hf import ImportOptions, plan_import

    _, plan = plan_import(exported["llama3"][0], ImportOptions(world_size=WORLD, to="torchtitan"))
    for name, heads in (("wq", 4), ("wk", 2)):
        target = plan.output.targets[f"layers.1.attention.qkv_linear.{name}.weight"]
        assert (target.shape, target.logical_shape) == ((heads * 16, 64), (heads * 8, 2, 64))
        assert [(p.src_start, p.dst_start, p.sizes, p.axes) for p in target.pieces[:2]] == [
            ((0, 0), (0, 0, 0), (8, 1, 64), (0, None, 1)), ((8, 0), (0, 1, 0), (8, 1, 64), (0, None, 1))]
        assert len(target.pieces) == 2 * heads


def test_llama3_rows_cut_mid_pair_export_the_same(saved, tmp_path):
    """Resharded to 5 ranks, wq and wk chunks end on odd rows: those chunks are read as the row-pair
    boxes their rows tile, still two pieces per head; the same bytes."""
    from ckptctl.commands.export_hf import ExportOptions, plan_export
    from ckptctl.formats.dcp.metadata import open_checkpoint
    from ckptctl.families.base import load_hf_config

    ckpt, state, ref = saved["llama3"]
    assert run_cli("reshard", ckpt, tmp_path / "ws5", "--world-size", "5").returncode == 0
    resharded = open_checkpoint(tmp_path / "ws5")
    assert resharded.tensors["layers.0.attention.qkv_linear.wq.weight"].chunks[0].sizes == (13, 64)
    plan = plan_export(resharded, load_hf_config(ref), ExportOptions())
    assert len(plan.targets["model.layers.0.self_attn.q_proj.weight"].pieces) == 8
    run = run_cli("export-hf", tmp_path / "ws5", tmp_path / "hf", "--hf-config", ref, "--verify")
    assert run.returncode == 0, run.stderr
    want, got = titan.to_hf("llama3", state), _folder(tmp_path / "hf")
    assert sorted(got) == sorted(want) and all(torch.equal(got[n], want[n]) for n in want)


@pytest.mark.full
def test_a_resharded_checkpoint_resumes_in_torchtitans_checkpoint_manager_bit_exactly(saved, tmp_path):
    """2 → 3 ranks: torchtitan's manager resumes model and AdamW state (the fused `wqkv` state
    too) from ckptctl's reshard, every tensor equal to what it saved."""
    ckpt, state, _ = saved["llama3"]
    run = run_cli("reshard", ckpt, tmp_path / "ws3", "--world-size", "3", "--verify")
    assert run.returncode == 0, run.stderr
    resumed = run_ranks(titan.resume, 3, "llama3", str(tmp_path / "ws3"))[0]
    want = {**state, **torch.load(ckpt.parent.parent / titan.OPTIMIZER_SAVED)}
    assert "optimizer.state.layers.0.attention.qkv_linear.wqkv.weight.exp_avg" in want
    assert sorted(resumed) == sorted(want)
    assert [n for n in want if not torch.equal(resumed[n], want[n])] == []


@pytest.mark.full  # the geometry is checked by default: tests/core/test_plan.py
def test_experts_cut_on_dim_1_under_expert_parallelism_export_slab_by_slab(tmp_path):
    """torchtitan's expert stacks under EP with FSDP `Shard(1)` on a 2 × 2 mesh: each chunk holds
    a run of rows of each of its experts. export-hf reads each run from its place in the chunk:
    every HF tensor equals torchtitan's own adapter's, bit for bit (and --verify agrees)."""
    full = run_ranks(titan.save_expert_parallel, 4, "qwen3-moe", str(tmp_path / "ckpt"))[0]
    stack = next(k for k in full if ".inner_experts.w" in k)
    chunks = open_checkpoint(tmp_path / "ckpt").tensors[stack].chunks
    assert {(c.offsets[:2], c.sizes[:2]) for c in chunks} == {
        ((e, f), (full[stack].shape[0] // 2, full[stack].shape[1] // 2))
        for e in (0, full[stack].shape[0] // 2) for f in (0, full[stack].shape[1] // 2)}
    (tmp_path / "config").mkdir()
    (tmp_path / "config" / "config.json").write_text(json.dumps(titan.hf_config("qwen3-moe")))
    run = run_cli("export-hf", tmp_path / "ckpt", tmp_path / "hf", "--hf-config", tmp_path / "config", "--verify")
    assert run.returncode == 0, run.stderr
    got, want = _folder(tmp_path / "hf"), titan.to_hf("qwen3-moe", full)
    assert sorted(got) == sorted(want)
    assert [k for k in want if not torch.equal(got[k], want[k])] == []


def test_llama3_rows_in_chunks_cut_across_columns_are_refused(tmp_path):
    from ckptctl.util.errors import CheckpointError
    from ckptctl.core.dtypes import float32
    from ckptctl.families.base import MegatronModel
    from ckptctl.families.torchtitan import rope_halves
    from ckptctl.core.checkpoint import Checkpoint, Chunk, TensorEntry

    name = "layers.0.attention.qkv_linear.wq.weight"
    halves = tuple(Chunk("__0_0.distcp", 0, 0, (0, c), (64, 32)) for c in (0, 32))
    ckpt = Checkpoint(tmp_path, {name: TensorEntry(name, (64, 64), float32, halves)}, {}, {})
    model = MegatronModel(ckpt, "")
    with pytest.raises(CheckpointError, match=r"wq\.weight: a chunk is cut across its columns, so its rows cannot "
                                              r"be read as RoPE pairs \(reshard it to whole-row chunks first\)"):
        rope_halves(model, model.view(name), 4)


def test_a_tied_lm_head_is_not_exported_with_a_note(exported):
    folder, run = exported["qwen3"]
    assert "lm_head.weight" not in _folder(folder)
    assert run.stderr.splitlines()[0] == ("note: lm_head.weight not exported: the config ties it to "
                                          "tok_embeddings.weight, which it equals")


@pytest.mark.parametrize("family", [pytest.param(f, marks=[pytest.mark.full] if f != "llama3" else [])
                                    for f in FAMILIES])
def test_import_to_torchtitan_loads_through_torchtitans_checkpoint_manager_with_transformers_logits(
        saved, exported, tmp_path, family):
    """The import, loaded by torchtitan's checkpoint manager into a model with other weights, is
    the saved model, and torchtitan's forward gives the logits transformers computes on the HF
    folder (to float rounding: FlexAttention against transformers' attention). llama3 (RoPE
    rows back) in `make test`; qwen3, qwen3 MoE (experts re-stacked, the expert bias as zeros)
    and DeepSeek-V3 under `make test-full` (one torchtitan load each)."""
    folder, _ = exported[family]
    run = run_cli("import-hf", folder, tmp_path / family, "--to", "torchtitan", "--world-size", WORLD, "--verify")
    assert run.returncode == 0, run.stderr
    _, state, _ = saved[family]
    loaded, logits = run_ranks(titan.load, WORLD, family, str(tmp_path / family))[0]
    assert sorted(loaded) == sorted(state)
    for name, tensor in state.items():
        assert torch.equal(loaded[name], tensor), (family, name)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        want = model(torch.tensor([titan.TOKENS])).logits
    torch.testing.assert_close(logits, want, rtol=1e-5, atol=1e-5)


def test_experts_are_slabs_of_the_stacks_and_an_all_zero_expert_bias_is_left_out_with_a_note(saved, exported):
    _, state, _ = saved["qwen3-moe"]
    folder, run = exported["qwen3-moe"]
    got = _folder(folder)
    w2 = state["layers.1.moe.routed_experts.inner_experts.w2_EDF"]
    assert torch.equal(got["model.layers.1.mlp.experts.3.down_proj.weight"], w2[3])
    assert not any("expert_bias" in n for n in got)
    assert ("note: 2 torchtitan expert biases (layers.*.moe.expert_bias_E) not exported: all zero, and "
            "qwen3_moe routes without one") in run.stderr.splitlines()


def test_deepseek_v3_maps_mla_shared_experts_and_its_expert_bias(saved, exported):
    _, state, _ = saved["deepseek-v3"]
    got = _folder(exported["deepseek-v3"][0])
    assert torch.equal(got["model.layers.1.mlp.gate.e_score_correction_bias"], state["layers.1.moe.expert_bias_E"])
    assert torch.equal(got["model.layers.2.self_attn.q_b_proj.weight"], state["layers.2.attention.wq_b.weight"])
    assert torch.equal(got["model.layers.1.mlp.shared_experts.up_proj.weight"],
                       state["layers.1.moe.shared_experts.w3.weight"])
    assert "model.layers.0.mlp.gate_proj.weight" in got and "model.layers.0.mlp.gate.weight" not in got


def test_a_trained_expert_bias_is_refused_unless_dropped_on_purpose(runs, saved, tmp_path):
    _, _, ref = saved["qwen3-moe"]
    root, states = runs
    state, ckpt = states[BIASED], root / BIASED / titan.SAVED
    assert state["layers.0.moe.expert_bias_E"].tolist() == [0.25, 0.5, 0.75, 1.0]
    run = run_cli("export-hf", ckpt, tmp_path / "o", "--hf-config", ref)
    assert (run.returncode, run.stderr) == (2, (
        f"ckptctl: error: {ckpt}: layers.0.moe.expert_bias_E is not zero (and 1 more): torchtitan's load-balancing "
        "expert bias moves tokens to other experts, and qwen3_moe routes without one, so the export would route "
        "differently; pass --drop-expert-bias to export without it, as torchtitan's own adapter does\n"))
    assert not (tmp_path / "o").exists()
    run = run_cli("export-hf", ckpt, tmp_path / "o", "--hf-config", ref, "--drop-expert-bias")
    assert run.returncode == 0, run.stderr
    assert ("note: 2 torchtitan expert biases (layers.*.moe.expert_bias_E) dropped (--drop-expert-bias): the "
            "export routes without them") in run.stderr.splitlines()
    want = titan.to_hf("qwen3-moe", state)
    got = _folder(tmp_path / "o")
    assert sorted(got) == sorted(want) and all(torch.equal(got[n], want[n]) for n in want)


def test_a_torchtitan_model_type_without_rules_is_refused(saved, tmp_path):
    ckpt, _, ref = saved["qwen3"]
    config = json.loads((ref / "config.json").read_text())
    other = tmp_path / "ref"
    other.mkdir()
    (other / "config.json").write_text(json.dumps({**config, "model_type": "gpt_oss"}))
    run = run_cli("export-hf", ckpt, tmp_path / "o", "--hf-config", other)
    assert (run.returncode, run.stderr) == (2, f"ckptctl: error: {other / 'config.json'}: model_type 'gpt_oss' of "
                                               "a torchtitan checkpoint is not one export-hf converts yet (it converts "
                                               "torchtitan's llama (torchtitan-llama3), qwen3 (torchtitan-qwen3), "
                                               "qwen3_moe (torchtitan-qwen3), deepseek_v3 (torchtitan-deepseek-v3))\n")
