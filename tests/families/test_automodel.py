"""NeMo Automodel's native grouped experts → Hugging Face, against Automodel's own adapter.

A tiny random transformers Qwen3-MoE model is converted to Automodel's native layout by
Automodel's `Qwen3MoeStateDictAdapter.from_hf` into Automodel's own model, and saved by 4
real gloo ranks on an (`ep`, `ep_shard`) mesh, the experts cut on both the expert and the
hidden dim (`fixtures.automodel`); Automodel's own `Checkpointer` saves it too (`model/` with
HF names through its adapter, or native without one; the native layout in `optim/`). `export-hf --arch auto` must write exactly what the adapter's own
`to_hf` gives, tensor by tensor and name by name, and transformers must load it whole and
compute the reference model's logits. The Checkpointer's folders and a cast export run under
`make test-full`. Skipped without `nemo-automodel` (`make install` puts it in the dev
environment).
"""

from __future__ import annotations

import json

import pytest
import torch

from fixtures import automodel, hf_models
from fixtures.gloo import run_ranks
from tests.conftest import run_cli

pytestmark = pytest.mark.skipif(not automodel.available(), reason="nemo-automodel is not installed")
transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """The native checkpoint, the HF reference and Automodel's own HF export of the native state."""
    root = tmp_path_factory.mktemp("automodel")
    ref = hf_models.reference("qwen3-moe", root / "ref", seed=3, **automodel.AUTOMODEL_OVERRIDES)
    native = automodel.native_state(ref.folder)
    torch.save(native, root / "native.pt")
    run_ranks(automodel.save_native, 4, str(root / "ckpt"), str(root / "native.pt"))
    return root / "ckpt", ref, automodel.to_hf(ref.folder, native)


@pytest.fixture(scope="module")
def exported(saved, tmp_path_factory):
    ckpt, ref, _ = saved
    out = tmp_path_factory.mktemp("automodel-hf") / "hf"
    run = run_cli("export-hf", ckpt, out, "--hf-config", ref.folder, "--verify", "--json")
    assert run.returncode == 0, run.stderr
    return out, json.loads(run.stdout)


@pytest.fixture(scope="module")
def checkpointed(saved, tmp_path_factory):
    """What Automodel's own Checkpointer writes for the same model (`step-1/model`, `step-1/optim`)."""
    _, ref, _ = saved
    out = tmp_path_factory.mktemp("automodel-checkpointer")
    run_ranks(automodel.checkpointer_save, 1, str(out), str(ref.folder))
    return out / "step-1"


@pytest.mark.full
def test_automodels_checkpointer_writes_hf_names_in_model_which_export_as_they_are(saved, checkpointed, tmp_path):
    from safetensors.torch import load_file

    _, ref, _ = saved
    run = run_cli("export-hf", checkpointed / "model", tmp_path / "hf", "--hf-config", ref.folder, "--json")
    assert run.returncode == 0, run.stderr
    assert json.loads(run.stdout)["arch"] == "raw"
    got = load_file(tmp_path / "hf" / "model.safetensors")
    assert sorted(got) == sorted(ref.state) and all(torch.equal(got[n], ref.state[n]) for n in got)


@pytest.mark.full
def test_automodels_checkpointer_without_the_adapter_writes_native_names_which_export_converts(saved, tmp_path):
    from safetensors.torch import load_file

    _, ref, own = saved
    run_ranks(automodel.checkpointer_save, 1, str(tmp_path / "ck"), str(ref.folder), False)
    model = tmp_path / "ck" / "step-1" / "model"
    run = run_cli("export-hf", model, tmp_path / "hf", "--hf-config", ref.folder, "--verify", "--json")
    assert run.returncode == 0, run.stderr
    assert json.loads(run.stdout)["arch"] == "automodel"
    got = load_file(tmp_path / "hf" / "model.safetensors")
    assert sorted(got) == sorted(own) and all(torch.equal(got[n], own[n]) for n in got)


@pytest.mark.full
def test_automodels_optimizer_state_is_native_and_reshards(checkpointed, tmp_path):
    """`optim/` keeps the grouped stacks' state, [E, H, 2I] and [E, I, H]: reshard lays it out again, torch loads it."""
    import torch.distributed.checkpoint as dcp

    from ckptctl.formats.dcp.metadata import open_checkpoint

    tensors = open_checkpoint(checkpointed / "optim").tensors
    stack = "optim.state.model.layers.1.mlp.experts."
    assert (tensors[stack + "gate_and_up_projs.exp_avg"].shape, tensors[stack + "down_projs.exp_avg_sq"].shape) == (
        (6, 32, 24), (6, 12, 32))
    run = run_cli("reshard", checkpointed / "optim", tmp_path / "ws3", "--world-size", "3", "--verify")
    assert run.returncode == 0, run.stderr
    names = [stack + "gate_and_up_projs.exp_avg", stack + "down_projs.exp_avg_sq"]
    before = {n: torch.empty(tensors[n].shape) for n in names}
    after = {n: torch.empty(tensors[n].shape) for n in names}
    dcp.load(before, checkpoint_id=checkpointed / "optim", no_dist=True)
    dcp.load(after, checkpoint_id=tmp_path / "ws3", no_dist=True)
    assert all(torch.equal(before[n], after[n]) for n in names) and before[names[0]].abs().sum() > 0


def test_the_expert_stacks_are_saved_cut_on_the_expert_and_the_hidden_dim(saved):
    from ckptctl.formats.dcp.metadata import open_checkpoint

    entry = open_checkpoint(saved[0]).tensors["model.layers.1.mlp.experts.gate_and_up_projs"]
    assert entry.shape == (6, 32, 24)
    assert sorted((c.offsets, c.sizes) for c in entry.chunks) == [
        ((0, 0, 0), (3, 16, 24)), ((0, 16, 0), (3, 16, 24)), ((3, 0, 0), (3, 16, 24)), ((3, 16, 0), (3, 16, 24))]


def test_export_is_automodels_own_to_hf_bit_for_bit(saved, exported):
    from safetensors.torch import load_file

    _, ref, own = saved
    folder, report = exported
    got = {}
    for path in sorted(folder.glob("*.safetensors")):
        got.update(load_file(path))
    assert report["arch"] == "automodel"
    assert sorted(got) == sorted(own) == sorted(ref.state)
    assert [n for n in got if not torch.equal(got[n], own[n])] == []
    assert [n for n in got if not torch.equal(got[n], ref.state[n])] == []


def test_transformers_loads_the_export_whole_with_the_reference_logits(saved, exported):
    _, ref, _ = saved
    model, info = transformers.AutoModelForCausalLM.from_pretrained(exported[0], output_loading_info=True,
                                                                     dtype=torch.float32)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    ids = torch.tensor([[1, 5, 9, 2, 7, 3]])
    with torch.no_grad():
        assert torch.equal(model.eval()(ids).logits, ref.model.eval()(ids).logits)


@pytest.mark.full
def test_a_bf16_export_is_the_cast_of_automodels_own(saved, tmp_path):
    from safetensors.torch import load_file

    ckpt, ref, own = saved
    run = run_cli("export-hf", ckpt, tmp_path / "hf", "--hf-config", ref.folder, "--dtype", "bf16",
                  "--include", "model.layers.1.mlp.experts.*")
    assert run.returncode == 0, run.stderr
    got = load_file(tmp_path / "hf" / "model.safetensors")
    assert len(got) == 6 * 3
    assert [n for n in got if not torch.equal(got[n], own[n].to(torch.bfloat16))] == []


def test_a_gate_and_up_stack_without_its_down_stack_is_refused(saved, tmp_path):
    import torch.distributed.checkpoint as dcp

    _, ref, _ = saved
    state = automodel.native_state(ref.folder)
    del state["model.layers.0.mlp.experts.down_projs"]
    dcp.save(state, checkpoint_id=tmp_path / "ckpt", no_dist=True)
    run = run_cli("export-hf", tmp_path / "ckpt", tmp_path / "hf", "--hf-config", ref.folder)
    assert (run.returncode, run.stdout) == (2, "")
    assert run.stderr == (f"ckptctl: error: {tmp_path / 'ckpt'}: model.layers.0.mlp.experts.down_projs is missing: "
                          "NeMo Automodel saves mlp.experts.gate_and_up_projs and mlp.experts.down_projs together\n")
    assert not (tmp_path / "hf").exists()


def test_stacks_of_disagreeing_shapes_are_refused(saved, tmp_path):
    import torch.distributed.checkpoint as dcp

    _, ref, _ = saved
    state = automodel.native_state(ref.folder)
    state["model.layers.0.mlp.experts.down_projs"] = torch.zeros(6, 10, 32)
    dcp.save(state, checkpoint_id=tmp_path / "ckpt", no_dist=True)
    run = run_cli("export-hf", tmp_path / "ckpt", tmp_path / "hf", "--hf-config", ref.folder)
    assert (run.returncode, run.stdout) == (2, "")
    assert run.stderr == (f"ckptctl: error: {tmp_path / 'ckpt'}: model.layers.0.mlp.experts.gate_and_up_projs "
                          "[6, 32, 24] and mlp.experts.down_projs [6, 10, 32] are not one expert layout "
                          "([E, H, 2I] or [E, H, I] with [E, I, H])\n")
