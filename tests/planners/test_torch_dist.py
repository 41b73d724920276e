"""Megatron-Core `torch_dist` checkpoints written by megatron-core itself: inspect and export-hf.

A tiny llama-like GPTModel (local spec, RoPE, RMSNorm, SwiGLU, GQA, padded vocab) is built
and saved by megatron-core's own `dist_checkpointing.save` at TP 1, TP 2 and PP 2 (each
stage its layers at their global index), as are a qwen3-like one and a Qwen3-MoE-like one
(SequentialMLP experts) at TP 2, also with a dense layer among the MoE ones (per-layer
keys), and its own forward gives the logits of a fixed batch (`fixtures.megatron_core`;
not pipelined). export-hf must give the HF Llama whose
every tensor is the independent test-side mapping of Megatron's global tensors and whose
logits (transformers) equal Megatron's; both TPs give the same folder.
Skipped without megatron-core (`make install` puts it in).
"""

from __future__ import annotations

import json
import re

import pytest
import torch

from ckptctl.formats.dcp.metadata import open_checkpoint
from fixtures import megatron_core as mc
from tests.conftest import run_cli

pytestmark = pytest.mark.skipif(not mc.available(), reason="megatron-core is not installed")
transformers = pytest.importorskip("transformers")
GRIDS = {"tp1": (1, 1, "llama"), "tp2": (2, 1, "llama"), "pp2": (1, 2, "llama"), "qwen3-tp2": (2, 1, "qwen3"),
         "qwen3-moe-tp2": (2, 1, "qwen3-moe"), "qwen3-moe-mixed-tp2": (2, 1, "qwen3-moe-mixed"),
         "singleton-tp2": (2, 1, "llama"), "qwen3-moe-singleton-tp2": (2, 1, "qwen3-moe"),
         "deepseek-v3-tp2": (2, 1, "deepseek-v3"), "deepseek-v3-singleton-tp2": (2, 1, "deepseek-v3"),
         "qwen2-tp2": (2, 1, "qwen2"), "mixtral-tp2": (2, 1, "mixtral"), "deepseek-v3-mtp-tp2": (2, 1, "deepseek-v3")}
"""Name → (TP, PP, model kind) of each saved checkpoint: qwen3 has q/k norms and its own head_dim;
qwen3-moe's SequentialMLP experts are saved as stacks of stacks [L, E, …]; qwen3-moe-mixed's
layers differ (MoE, then dense), so torch_dist keeps per-layer keys; the singleton ones are
saved with `singleton_local_shards` (per-layer keys, fc1 as weight_w / weight_v, a key per expert);
deepseek-v3 has multi-latent attention, a first dense layer, then MoE with a shared expert and
sigmoid group-limited routing steered by its expert bias; qwen2 has q/k/v biases (TP-split with
the rows of its group); mixtral is qwen3-moe's MoE without q/k norms, under Mixtral's names;
deepseek-v3-mtp adds a multi-token prediction layer (`mtp.layers.0.`, its experts a stack [E, …]),
which the export writes as HF's layer L (`num_nextn_predict_layers`)."""
MTP = ("deepseek-v3-mtp-tp2",)
SINGLETON = ("singleton-tp2", "qwen3-moe-singleton-tp2", "deepseek-v3-singleton-tp2")


FULL_ONLY = ("tp1", "pp2", "qwen3-tp2", "qwen3-moe-tp2", "qwen3-moe-mixed-tp2", "singleton-tp2", "qwen3-moe-singleton-tp2",
             "deepseek-v3-tp2", "deepseek-v3-singleton-tp2", "qwen2-tp2", "mixtral-tp2", "deepseek-v3-mtp-tp2")
"""Grids run by `make test-full` only: tp2 covers the layer stacks and a TP split, and each grid
costs a megatron-core save under torchrun (qwen3-moe's stacks of expert stacks run there, with
the q/k norms and the per-layer keys of the others; DeepSeek-V3's mapping is also checked by
default against Megatron-Bridge's, tests/commands/test_megatron_bridge.py)."""


class Saved:
    """Each grid's checkpoint, saved by megatron-core the first time a test asks for it, with
    Megatron's logits (None when pipelined); and each model kind's HF config folder."""

    def __init__(self, root) -> None:
        self.root = root
        self.ckpts: dict[str, tuple] = {}
        self.exports: dict[str, object] = {}

    def __getitem__(self, grid: str) -> tuple:
        if grid not in self.ckpts:
            tp, pp, kind = GRIDS[grid]
            mc.write(self.root / grid, tp, pp, kind=kind, singleton=grid in SINGLETON, mtp=int(grid in MTP))
            logits = self.root / f"{grid}.logits.pt"
            self.ckpts[grid] = (self.root / grid, torch.load(logits) if logits.exists() else None)
        return self.ckpts[grid]

    def ref(self, kind: str, mtp: int = 0):
        folder = self.root / f"ref-{kind}{'-mtp' * bool(mtp)}"
        if not folder.exists():
            folder.mkdir()
            config = mc.hf_config(kind)
            if mtp:
                config["num_nextn_predict_layers"] = mtp
            (folder / "config.json").write_text(json.dumps(config))
        return folder

    def exported(self, grid: str):
        """The grid's export-hf folder (`--verify`)."""
        if grid not in self.exports:
            out = self.root / f"{grid}-hf"
            run = run_cli("export-hf", self[grid][0], out, "--hf-config", self.ref(GRIDS[grid][2], int(grid in MTP)),
                          "--verify")
            assert run.returncode == 0, run.stderr
            self.exports[grid] = out
        return self.exports[grid]


@pytest.fixture(scope="session")
def saved(tmp_path_factory):
    return Saved(tmp_path_factory.mktemp("torch_dist"))


def grids(*names: str) -> list:
    return [pytest.param(n, marks=pytest.mark.full) if n in FULL_ONLY else n for n in names]


def megatron_to_hf(state: dict, kind: str) -> dict[str, torch.Tensor]:
    """Test side, independent of ckptctl: Megatron's global layer stacks (or per-layer keys) → HF
    Llama/Qwen2/Qwen3/Qwen3-MoE/Mixtral/DeepSeek-V3 tensors."""
    d = mc.DIMS
    hd, groups, per_group = mc.HEAD_DIM[kind], d["groups"], d["heads"] // d["groups"]
    out = {"model.embed_tokens.weight": state["embedding.word_embeddings.weight"][:d["vocab"]],
           "lm_head.weight": state["output_layer.weight"][:d["vocab"]],
           "model.norm.weight": state["decoder.final_layernorm.weight"]}
    moe = mc.MOE_KINDS[kind].get("moe_layer_freq", [1] * d["layers"]) if kind in mc.MOE_KINDS else [0] * d["layers"]
    mtp = sorted({int(k.split(".")[2]) for k in state if k.startswith("mtp.layers.")})
    moe = [*moe, *(moe[-1:] * len(mtp))]
    for layer in range(d["layers"] + len(mtp)):
        p = f"model.layers.{layer}."
        base = (f"decoder.layers.{layer}." if layer < d["layers"]
                else f"mtp.layers.{layer - d['layers']}.transformer_layer.")

        def s(name: str, layer: int = layer, base: str = base) -> torch.Tensor:  # a per-layer key, else a stack's slab
            return state[base + name] if base + name in state else state["decoder.layers." + name][layer]

        if layer >= d["layers"]:  # an MTP layer: its own norms and projection, then a transformer layer like the last
            mtp_layer = f"mtp.layers.{layer - d['layers']}."
            for hf_name, mg_name in (("enorm", "enorm"), ("hnorm", "hnorm"), ("eh_proj", "eh_proj"),
                                     ("shared_head.norm", "final_layernorm")):
                out[p + f"{hf_name}.weight"] = state[f"{mtp_layer}{mg_name}.weight"]

        if kind == "deepseek-v3":  # MLA: one to one, the local spec's norms under their own names
            for hf_name, mg_name in (("q_a_proj", "linear_q_down_proj"), ("q_b_proj", "linear_q_up_proj"),
                                     ("kv_a_proj_with_mqa", "linear_kv_down_proj"), ("kv_b_proj", "linear_kv_up_proj"),
                                     ("q_a_layernorm", "q_layernorm"), ("kv_a_layernorm", "kv_layernorm")):
                out[p + f"self_attn.{hf_name}.weight"] = s(f"self_attention.{mg_name}.weight")
        else:
            qkv = s("self_attention.linear_qkv.weight").reshape(groups, (per_group + 2) * hd, d["hidden"])
            out[p + "self_attn.q_proj.weight"] = qkv[:, :per_group * hd].reshape(-1, d["hidden"])
            out[p + "self_attn.k_proj.weight"] = qkv[:, per_group * hd:(per_group + 1) * hd].reshape(-1, d["hidden"])
            out[p + "self_attn.v_proj.weight"] = qkv[:, (per_group + 1) * hd:].reshape(-1, d["hidden"])
            if kind == "qwen2":  # the bias rows interleaved per group like the weight's
                bias = s("self_attention.linear_qkv.bias").reshape(groups, (per_group + 2) * hd)
                out[p + "self_attn.q_proj.bias"] = bias[:, :per_group * hd].reshape(-1)
                out[p + "self_attn.k_proj.bias"] = bias[:, per_group * hd:(per_group + 1) * hd].reshape(-1)
                out[p + "self_attn.v_proj.bias"] = bias[:, (per_group + 1) * hd:].reshape(-1)
        out[p + "self_attn.o_proj.weight"] = s("self_attention.linear_proj.weight")
        def gate_up(prefix: str, expert: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
            """fc1 as [W; V] (whatever the TP), or saved as weight_w and weight_v (singleton shards)."""
            split = f"{base}{prefix}{'' if expert is None else f'{expert}.'}linear_fc1.weight_w"
            if split in state:
                return state[split], state[split[:-1] + "v"]
            fc1 = s(prefix + "linear_fc1.weight")
            fc1 = fc1 if expert is None else fc1[expert]
            return fc1[:fc1.shape[0] // 2], fc1[fc1.shape[0] // 2:]

        if moe[layer] and kind == "mixtral":  # Mixtral's own names: w1 gate, w3 up, w2 down
            out[p + "block_sparse_moe.gate.weight"] = s("mlp.router.weight")
            for e in range(mc.MOE["num_moe_experts"]):
                x = f"{p}block_sparse_moe.experts.{e}."
                out[x + "w1.weight"], out[x + "w3.weight"] = gate_up("mlp.experts.experts.", e)
                out[x + "w2.weight"] = s("mlp.experts.experts.linear_fc2.weight")[e]
        elif moe[layer]:
            out[p + "mlp.gate.weight"] = s("mlp.router.weight")
            if kind == "deepseek-v3":
                out[p + "mlp.gate.e_score_correction_bias"] = s("mlp.router.expert_bias")
                x = p + "mlp.shared_experts."
                out[x + "gate_proj.weight"], out[x + "up_proj.weight"] = gate_up("mlp.shared_experts.")
                out[x + "down_proj.weight"] = s("mlp.shared_experts.linear_fc2.weight")
            for e in range(mc.MOE["num_moe_experts"]):
                x, per_expert = f"{p}mlp.experts.{e}.", f"decoder.layers.{layer}.mlp.experts.experts.{e}."
                out[x + "gate_proj.weight"], out[x + "up_proj.weight"] = gate_up("mlp.experts.experts.", e)
                fc2 = per_expert + "linear_fc2.weight"
                out[x + "down_proj.weight"] = state[fc2] if fc2 in state else s("mlp.experts.experts.linear_fc2.weight")[e]
        else:
            out[p + "mlp.gate_proj.weight"], out[p + "mlp.up_proj.weight"] = gate_up("mlp.")
            out[p + "mlp.down_proj.weight"] = s("mlp.linear_fc2.weight")
        if kind == "deepseek-v3":  # the MLA local spec keeps its layer norms' own names
            out[p + "input_layernorm.weight"] = s("input_layernorm.weight")
            out[p + "post_attention_layernorm.weight"] = s("pre_mlp_layernorm.weight")
            continue
        out[p + "input_layernorm.weight"] = s("self_attention.linear_qkv.layer_norm_weight")
        out[p + "post_attention_layernorm.weight"] = s("mlp.linear_fc1.layer_norm_weight")
        if kind not in mc.NO_QK_NORM:
            out[p + "self_attn.q_norm.weight"] = s("self_attention.q_layernorm.weight")
            out[p + "self_attn.k_norm.weight"] = s("self_attention.k_layernorm.weight")
    return out


@pytest.mark.full
def test_legacy_grouped_gemm_experts_export_slab_by_slab(tmp_path):
    """megatron-core's legacy GroupedMLP (grouped-GEMM experts without Transformer Engine) saves a
    TP rank's rows of every local expert as one chunk [1, E, R, H], not a chunk per expert (as
    SequentialMLP and Transformer Engine's TEGroupedMLP save them): each expert's rows are read
    from their place in the chunk, and the export is the mapped model torch's own loader reads."""
    from fixtures.make_fixtures import load_with_torch
    from safetensors.torch import load_file

    mc.write(tmp_path / "ckpt", 2, 1, kind="qwen3-moe-grouped", logits=False)
    fc1 = open_checkpoint(tmp_path / "ckpt").tensors["decoder.layers.mlp.experts.experts.linear_fc1.weight"]
    assert {(c.offsets[:3], c.sizes[:3]) for c in fc1.chunks} >= {((0, 0, 0), (1, 4, 12))}
    (tmp_path / "config").mkdir()
    (tmp_path / "config" / "config.json").write_text(json.dumps(mc.hf_config("qwen3-moe-grouped")))
    run = run_cli("export-hf", tmp_path / "ckpt", tmp_path / "hf", "--hf-config", tmp_path / "config", "--verify")
    assert run.returncode == 0, run.stderr
    want = megatron_to_hf(load_with_torch(tmp_path / "ckpt"), "qwen3-moe-grouped")
    got = load_file(tmp_path / "hf" / "model.safetensors")
    assert sorted(got) == sorted(want)
    assert [name for name, tensor in want.items() if not torch.equal(got[name], tensor)] == []


@pytest.mark.parametrize("grid", grids(*GRIDS))
def test_export_is_the_mapped_megatron_model_and_computes_megatrons_logits(saved, grid):
    from fixtures.make_fixtures import load_with_torch
    from safetensors.torch import load_file

    ckpt, logits = saved[grid]
    want = megatron_to_hf(load_with_torch(ckpt), GRIDS[grid][2])
    got = load_file(saved.exported(grid) / "model.safetensors")
    assert sorted(got) == sorted(want)
    for name, tensor in want.items():
        assert torch.equal(got[name], tensor), name
    if logits is None:
        return
    model = transformers.AutoModelForCausalLM.from_pretrained(saved.exported(grid), dtype=torch.float32)
    with torch.no_grad():
        hf_logits = model(mc.TOKENS).logits
    torch.testing.assert_close(hf_logits, logits[..., :mc.DIMS["vocab"]], rtol=0, atol=1e-6)


@pytest.mark.full
def test_exports_at_tp_1_and_2_are_the_same_folder(saved):
    run = run_cli("diff", saved.exported("tp1"), saved.exported("tp2"))
    assert (run.returncode, run.stdout) == (0, "21 tensors: 21 equal, 0 close, 0 differs\n")


@pytest.mark.parametrize("grid, layouts", [pytest.param("tp1", {"layer-stacked": 6, "single": 3},
                                                        marks=pytest.mark.full),
                                           ("tp2", {"layer-stacked": 6, "shard0-even": 2, "single": 1}),
                                           pytest.param("pp2", {"layer-stacked": 6, "single": 3},
                                                        marks=pytest.mark.full)])
def test_inspect_names_the_format_and_labels_layer_stacks(saved, grid, layouts):
    ckpt = saved[grid][0]
    run = run_cli("inspect", ckpt, "--json")
    assert run.returncode == 0, run.stderr
    doc = json.loads(run.stdout)
    world = GRIDS[grid][0] * GRIDS[grid][1]
    assert (doc["format"], doc["layouts"], doc["world_size"]) == ("megatron-core torch_dist", layouts, world)
    assert doc["megatron_core"] == {"versions": "0.18 or older", "evidence": "common state in common.pt"}  # 0.16.1's
    assert doc["tensors"]["decoder.layers.mlp.linear_fc1.weight"]["shape"] == [2, 96, 32]
    assert not doc["problems"]
    text = run_cli("inspect", ckpt).stdout
    assert re.search(r"^Format\s+Megatron-Core dist_checkpointing, torch_dist backend \(metadata\.json\): "
                     r"layer-stacked keys, fc1 as \[W_all; V_all\] or weight_w/weight_v \(TP-invariant\)\s*$", text, re.M)
    assert re.search(r"^Saved by\s+megatron-core 0\.18 or older \(common state in common\.pt\)\s*$", text, re.M)


def test_reshard_keeps_a_torch_dist_checkpoints_own_layout(saved, tmp_path):
    """A model-only torch_dist checkpoint is copied chunk for chunk with its metadata.json and
    common.pt; another world size is refused, naming what megatron-core does itself, and so is a
    conversion to Megatron-FSDP without the args that say the model spec."""
    ckpt = saved["tp2"][0]
    run = run_cli("reshard", ckpt, tmp_path / "o", "-n", "3")
    assert (run.returncode, run.stderr) == (2, TORCH_DIST_LAYOUT.format(2))
    run = run_cli("reshard", ckpt, tmp_path / "o", "--layout", "megatron-fsdp", "--tp", "2", "--dp", "1")
    assert (run.returncode, run.stderr) == (2, f"ckptctl: error: {ckpt}: common.pt: no Megatron args: the model "
                                               "spec is unknown\n")  # which names its norms, whether fc1 is gated
    run = run_cli("reshard", ckpt, tmp_path / "o", "--layout", "torch-dist")
    assert (run.returncode, run.stderr) == (2, "ckptctl: error: already a torch_dist checkpoint: pass no --layout (it "
                                               "is rewritten at its own layout with its optimizer state in model "
                                               "space)\n")
    plan = json.loads(run_cli("reshard", ckpt, tmp_path / "o", "--dry-run", "--json").stdout)
    assert (plan["world_size"], plan["files"]) == (2, 5)  # two rank files, .metadata, metadata.json, common.pt
    run = run_cli("reshard", ckpt, tmp_path / "o", "--verify")
    assert run.returncode == 0, run.stderr
    assert run_cli("diff", ckpt, tmp_path / "o").returncode == 0
    assert len(list((tmp_path / "o").iterdir())) == 5
    for name in ("metadata.json", "common.pt"):
        assert (tmp_path / "o" / name).read_bytes() == (ckpt / name).read_bytes()


def test_optimizer_state_of_no_known_format_is_refused_not_copied(saved, tmp_path):
    """The rewrite promises the optimizer state in model space: state it cannot name (here a
    model tensor renamed `optimizer.state.foo.…`) is refused, never copied as if rewritten."""
    import pickle
    import shutil

    from torch.distributed.checkpoint.metadata import MetadataIndex

    src = tmp_path / "src"
    shutil.copytree(saved["tp2"][0], src)
    md = pickle.loads((src / ".metadata").read_bytes())
    old, new = "decoder.final_layernorm.weight", "optimizer.state.foo.decoder.final_layernorm.weight"
    md.state_dict_metadata[new] = md.state_dict_metadata.pop(old)
    md.storage_data = {(MetadataIndex(new, k.offset, k.index) if k.fqn == old else k): v
                       for k, v in md.storage_data.items()}
    (src / ".metadata").write_bytes(pickle.dumps(md))
    run = run_cli("reshard", src, tmp_path / "o")
    assert (run.returncode, run.stderr) == (2, f"ckptctl: error: {src}: {new}: optimizer state of no "
                                               "DistributedOptimizer format known (dp_reshardable, "
                                               "fully_sharded_model_space, fully_reshardable): not rewritten\n")
    assert not (tmp_path / "o").exists()


TORCH_DIST_LAYOUT = ("ckptctl: error: a torch_dist checkpoint is rewritten at its own layout with its optimizer state "
                     "in model space (fully_reshardable), which megatron-core loads at any TP and DP: pass no "
                     "--world-size (or its own, {}), layout, TP, filter or dtype options\n")


def test_export_torch_writes_what_torchs_own_converter_writes(saved, tmp_path):
    from fixtures.make_fixtures import load_with_torch

    ckpt = saved["tp2"][0]
    run = run_cli("export-torch", ckpt, tmp_path / "o.pt", "--exclude", "*_extra_state*")
    assert run.returncode == 0, run.stderr
    got, want = torch.load(tmp_path / "o.pt", weights_only=True), load_with_torch(ckpt)
    tensors = {k: v for k, v in want.items() if isinstance(v, torch.Tensor)}
    assert sorted(got) == sorted(tensors)
    assert all(torch.equal(got[k], v) for k, v in tensors.items())


def _with_args(src, dst, **args):
    """A copy of model-only save `src` whose common.pt holds Megatron-LM's args (these saves have
    none; the conversion to Megatron-FSDP needs the spec, SwiGLU, the TP)."""
    import argparse
    import shutil

    shutil.copytree(src, dst)
    common = torch.load(dst / "common.pt", weights_only=False)
    common["args"] = argparse.Namespace(transformer_impl="local", swiglu=True, **args)
    torch.save(common, dst / "common.pt")
    return dst


@pytest.mark.full
@pytest.mark.full
@pytest.mark.parametrize("grouped", [False, True])
def test_singleton_shards_and_stacks_convert_to_the_same_megatron_fsdp_checkpoint(saved, tmp_path, grouped):
    """megatron-core's `singleton_local_shards` save (a key per layer and per expert, fc1 as weight_w /
    weight_v) and its stacks hold one model: converted to fsdp_dtensor they are the same
    checkpoint, each expert by its module name (SequentialMLP's, or TEGroupedMLP's with
    `moe_grouped_gemm`)."""
    outs = []
    for grid in ("qwen3-moe-tp2", "qwen3-moe-singleton-tp2"):
        src = _with_args(saved[grid][0], tmp_path / grid, tensor_model_parallel_size=2,
                         pipeline_model_parallel_size=1, moe_grouped_gemm=grouped)
        run = run_cli("reshard", src, tmp_path / f"{grid}-mfsdp", "--layout", "megatron-fsdp", "--dp", "1", "--verify")
        assert run.returncode == 0, run.stderr
        outs.append(tmp_path / f"{grid}-mfsdp")
    run = run_cli("diff", *outs)
    assert (run.returncode, run.stdout) == (0, "41 tensors: 41 equal, 0 close, 0 differs; 1 bytes entry: 1 equal, "
                                               "0 differs\n")
    doc = json.loads(run_cli("inspect", outs[0], "--json").stdout)
    expert = "model.module.decoder.layers.1.mlp.experts." + ("linear_fc1.weight3_v" if grouped else
                                                             "local_experts.3.linear_fc1.weight_v")
    assert doc["tensors"][expert]["shape"] == [24, 32]


@pytest.mark.full
def test_a_pipelined_save_converts_to_one_megatron_fsdp_stage(saved, tmp_path):
    """torch_dist keeps global layer indices whatever the PP: a PP 2 save converts to fsdp_dtensor
    (its args then say PP 1), whose export is the save's; converted back it is the save."""
    src = _with_args(saved["pp2"][0], tmp_path / "pp2", tensor_model_parallel_size=1, pipeline_model_parallel_size=2)
    out = tmp_path / "mfsdp"
    run = run_cli("reshard", src, out, "--layout", "megatron-fsdp", "--dp", "2", "--verify")
    assert run.returncode == 0, run.stderr
    run = run_cli("export-hf", out, tmp_path / "hf", "--hf-config", saved.ref("llama"))
    assert run.returncode == 0, run.stderr
    assert run_cli("diff", tmp_path / "hf", saved.exported("pp2")).returncode == 0
    doc = json.loads(run_cli("inspect", out, "--json").stdout)
    assert (doc["training"]["tp"], doc["training"]["pp"], doc["training"]["dp"]) == (1, 1, None)
    run = run_cli("reshard", out, tmp_path / "back", "--layout", "torch-dist")
    assert run.returncode == 0, run.stderr
    counts = json.loads(run_cli("diff", tmp_path / "back", src, "--json").stdout)["counts"]
    assert counts == {"equal": 9, "close": 0, "differs": 0, "shape differs": 0, "dtype differs": 0,
                      "missing in A": 0, "missing in B": 0}  # the save's _extra_state items are not carried
