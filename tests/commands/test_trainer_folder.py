"""HF Trainer / accelerate `checkpoint-N/` folders, saved by accelerate's own `save_fsdp_model` /
`save_fsdp_optimizer` on 2 gloo ranks (`fixtures/trainer_folder.py`), read back by its own
`load_fsdp_model` / `load_fsdp_optimizer`.

`inspect` shows both DCP parts and the per-rank RNG files; `reshard` writes both parts at the new
world size under the same names, copies the files of no rank byte for byte, and refuses per-rank
files saved at another world size unless `--exclude` drops them; `export-hf` reads the model part.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import pytest
import torch

from fixtures import trainer_folder as tf
from fixtures.gloo import run_ranks
from tests.conftest import run_cli, tiny_llama_folder

pytest.importorskip("accelerate")


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    """The Trainer's folder of TinyModel after one AdamW step at 2 ranks, and its full state."""
    root = tmp_path_factory.mktemp("trainer")
    ref = run_ranks(tf.save, 2, str(root), "trainer", timeout=240)[0]
    return root / tf.FOLDERS["trainer"], ref


def _tree(root: Path) -> dict[str, str]:
    """Every file under `root` by relative path: its sha256."""
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def _assert_same_state(got: dict, ref: dict) -> None:
    assert got["model"].keys() == ref["model"].keys()
    for name, value in ref["model"].items():
        assert torch.equal(got["model"][name], value), name
    assert got["optim"]["state"].keys() == ref["optim"]["state"].keys()
    for name, states in ref["optim"]["state"].items():
        assert states.keys() == got["optim"]["state"][name].keys()
        for key, value in states.items():
            assert torch.equal(got["optim"]["state"][name][key], value), (name, key)
    assert got["optim"]["param_groups"] == ref["optim"]["param_groups"]


def test_inspect_shows_both_parts_and_the_per_rank_files(saved) -> None:
    folder, _ = saved
    result = run_cli("inspect", folder)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[:6] == [
        f"Checkpoint folder  {folder}",
        "Format             HF Trainer / accelerate checkpoint folder (FSDP, SHARDED_STATE_DICT)",
        "Model              pytorch_model_fsdp_0: saved world size 2, 8 tensors, 0 bytes entries",
        "Optimizer          optimizer_0: saved world size 2, 24 tensors, 13 bytes entries",
        "Per-rank files     rng_state_{0..1}.pth: the Trainer's RNG state of 2 ranks, kept by a reshard to 2 ranks "
        "only (--exclude 'rng_state*.pth' drops it)",
        "Other files        scheduler.pt, trainer_state.json: of no rank, copied by a reshard as they are"]
    assert "pytorch_model_fsdp_0" in lines and "optimizer_0" in lines
    doc = json.loads(run_cli("inspect", folder, "--json").stdout)
    assert {k: v for k, v in doc.items() if k != "parts"} == {
        "path": str(folder), "format": "hf-trainer folder",
        "rank_files": [{"kind": "the Trainer's RNG state", "files": ["rng_state_0.pth", "rng_state_1.pth"],
                        "ranks": 2, "exclude": "rng_state*.pth", "shared": False}],
        "files": ["scheduler.pt", "trainer_state.json"], "rank_shards": [], "others": []}
    assert [(name, part["kind"], part["world_size"], part["groups"]) for name, part in doc["parts"].items()] == [
        ("pytorch_model_fsdp_0", "model", 2, {"model": 8, "optimizer": 0, "other": 0}),
        ("optimizer_0", "optimizer", 2, {"model": 0, "optimizer": 37, "other": 0})]
    check = run_cli("inspect", folder, "--check")
    assert (check.returncode, check.stdout) == (0, "ok: 32 tensors complete and consistent in 2 parts\n")
    filtered = json.loads(run_cli("inspect", folder, "--json", "--filter", "*.exp_avg").stdout)["parts"]
    assert [len(filtered[p]["tensors"]) for p in ("pytorch_model_fsdp_0", "optimizer_0")] == [0, 8]
    none = run_cli("inspect", folder, "--filter", "nothing.*")
    assert (none.returncode, none.stderr) == (2, "ckptctl: error: --filter 'nothing.*' matches none of the entries "
                                                 "of pytorch_model_fsdp_0, optimizer_0\n")


def test_a_reshard_to_another_world_size_refuses_the_per_rank_files(saved, tmp_path: Path) -> None:
    folder, _ = saved
    result = run_cli("reshard", folder, tmp_path / "ws3", "-n", 3)
    assert (result.returncode, result.stdout) == (2, "")
    assert result.stderr == (
        "ckptctl: error: rng_state_{0..1}.pth: the Trainer's RNG state of 2 ranks cannot follow a reshard to 3 "
        "(each process loads its own file); pass --exclude 'rng_state*.pth' to drop it (the resumed job keeps the "
        "random streams it seeds itself) or --keep-common-ranks to keep the files of the ranks both sizes have\n")
    assert os.listdir(tmp_path) == []


def test_resharded_to_3_ranks_accelerate_loads_both_parts_bit_exactly(saved, tmp_path: Path) -> None:
    folder, ref = saved
    before = _tree(folder)
    dst = tmp_path / "checkpoint-1"
    result = run_cli("reshard", folder, dst, "-n", 3, "--exclude", "rng_state*.pth", "--json")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert (report["world_size"], report["dropped"], list(report["parts"])) == (
        3, ["rng_state_0.pth", "rng_state_1.pth"], ["pytorch_model_fsdp_0", "optimizer_0"])
    assert report["copied"] == {n: (folder / n).stat().st_size for n in ("scheduler.pt", "trainer_state.json")}
    assert sorted(os.listdir(dst)) == ["optimizer_0", "pytorch_model_fsdp_0", "scheduler.pt", "trainer_state.json"]
    for part in ("pytorch_model_fsdp_0", "optimizer_0"):
        assert sorted(os.listdir(dst / part)) == [".metadata", "__0_0.distcp", "__1_0.distcp", "__2_0.distcp"]
    after = _tree(dst)
    assert {n: after[n] for n in ("scheduler.pt", "trainer_state.json")} == \
        {n: before[n] for n in ("scheduler.pt", "trainer_state.json")}
    assert _tree(folder) == before  # the source is never modified
    _assert_same_state(run_ranks(tf.load, 3, str(dst), timeout=240)[0], ref)


def test_at_the_same_world_size_every_file_follows(saved, tmp_path: Path) -> None:
    folder, _ = saved
    dst = tmp_path / "again"
    result = run_cli("reshard", folder, dst, "-n", 2, "--verify")
    assert result.returncode == 0, result.stderr
    assert result.stderr.startswith(f"wrote {dst} (pytorch_model_fsdp_0: 8 tensors, ")
    assert "; 4 files copied)" in result.stderr and result.stderr.endswith(", verified\n")
    copied = ("rng_state_0.pth", "rng_state_1.pth", "scheduler.pt", "trainer_state.json")
    assert {n: _tree(dst)[n] for n in copied} == {n: _tree(folder)[n] for n in copied}


def test_keep_common_ranks_keeps_the_files_both_sizes_have(saved, tmp_path: Path, fixture_ckpt) -> None:
    """At 3 ranks ranks 0 and 1 keep their files (rank 2 starts afresh, as the Trainer does without
    one); at 1 process the Trainer reads `rng_state.pth`, which no rank saved: refused."""
    folder, _ = saved
    result = run_cli("reshard", folder, tmp_path / "ws3", "-n", 3, "--keep-common-ranks", "--json")
    assert result.returncode == 0, result.stderr
    assert (json.loads(result.stdout)["dropped"], sorted(os.listdir(tmp_path / "ws3"))) == (
        [], ["optimizer_0", "pytorch_model_fsdp_0", "rng_state_0.pth", "rng_state_1.pth", "scheduler.pt",
             "trainer_state.json"])
    for name in ("rng_state_0.pth", "rng_state_1.pth"):
        assert (tmp_path / "ws3" / name).read_bytes() == (folder / name).read_bytes()
    one = run_cli("reshard", folder, tmp_path / "ws1", "-n", 1, "--keep-common-ranks")
    assert (one.returncode, one.stderr) == (2, (
        "ckptctl: error: rng_state_{0..1}.pth: a job of 1 process reads none of these files (rng_state.pth at one "
        "process, one file per process at several); pass --exclude 'rng_state*.pth' to drop them\n"))
    plain = run_cli("reshard", fixture_ckpt("fsdp2_4ranks"), tmp_path / "plain", "-n", 2, "--keep-common-ranks")
    assert (plain.returncode, plain.stderr) == (2, (
        "ckptctl: error: --keep-common-ranks keeps per-rank files of an HF Trainer / accelerate checkpoint folder, or "
        "a Megatron-FSDP checkpoint's per-DP RNG state; this checkpoint's per-rank entries are dropped with "
        "--exclude\n"))
    assert sorted(os.listdir(tmp_path)) == ["ws3"]


def test_dry_run_writes_nothing(saved, tmp_path: Path) -> None:
    folder, _ = saved
    result = run_cli("reshard", folder, tmp_path / "plan", "-n", 4, "--exclude", "rng_state*", "--dry-run")
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == [
        f"Dry run               nothing written to {tmp_path / 'plan'}",
        f"Source                {folder}",
        "pytorch_model_fsdp_0  8 tensors, 4 data files + .metadata at world size 4",
        "optimizer_0           24 tensors, 4 data files + .metadata at world size 4",
        "Copied                scheduler.pt, trainer_state.json",
        "Dropped               rng_state_0.pth, rng_state_1.pth"]
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("damage, error", [
    ("subfolder", "{folder}/extra: neither a DCP part of the Trainer checkpoint folder nor a file: no rule carries it "
                  "to another world size"),
    ("rank_shard", "{folder}/optimizer_0_rank0.bin: a process's shard saved with use_dcp=False (torch.save); "
                   "ckptctl reshards DCP parts only"),
    ("half_excluded", "--exclude keeps 1 of the 2 files of rng_state_{{0..1}}.pth: drop them all (--exclude "
                      "'rng_state*.pth') or none"),
    ("megatron", "{folder}: a Trainer checkpoint folder's parts are resharded as FSDP2 saves them; --layout, --tp, "
                 "--dp and the other Megatron options apply to Megatron checkpoints"),
    ("include", "--include selects the entries of one DCP checkpoint; on a Trainer checkpoint folder pass one of its "
                "parts ({folder}/pytorch_model_fsdp_0, {folder}/optimizer_0) or use --exclude"),
])
def test_what_no_rule_carries_is_refused(saved, tmp_path: Path, damage: str, error: str) -> None:
    folder = tmp_path / "checkpoint-1"
    shutil.copytree(saved[0], folder)
    args = ["-n", "2"]
    if damage == "subfolder":
        (folder / "extra").mkdir()
    elif damage == "rank_shard":
        (folder / "optimizer_0_rank0.bin").write_bytes(b"shard")
    elif damage == "half_excluded":
        args += ["--exclude", "rng_state_1.pth"]
    elif damage == "megatron":
        args += ["--layout", "megatron-fsdp"]
    else:
        args += ["--include", "model.*"]
    result = run_cli("reshard", folder, tmp_path / "out", *args)
    assert (result.returncode, result.stderr) == (2, f"ckptctl: error: {error.format(folder=folder)}\n")
    assert not (tmp_path / "out").exists()


def test_a_part_that_fails_leaves_no_output(saved, tmp_path: Path) -> None:
    """The model part is written, then the optimizer part's data is short: DST never appears, and no
    temporary directory is left beside it."""
    folder = tmp_path / "checkpoint-1"
    shutil.copytree(saved[0], folder)
    data = folder / "optimizer_0" / "__1_0.distcp"
    data.write_bytes(data.read_bytes()[:100])
    result = run_cli("reshard", folder, tmp_path / "out" / "checkpoint-1", "-n", 2)
    assert result.returncode == 2
    assert result.stderr.startswith(f"ckptctl: error: {data}: ")
    assert os.listdir(tmp_path / "out") == []


def test_other_commands_name_the_parts(saved) -> None:
    folder, _ = saved
    result = run_cli("export-torch", folder, folder.parent / "model.pt")
    assert (result.returncode, result.stderr) == (2, (
        f"ckptctl: error: {folder}: no .metadata file (not a DCP checkpoint?); an HF Trainer / accelerate checkpoint "
        "folder: inspect, reshard and export-hf take it whole, other commands one of its DCP parts: "
        f"{folder}/pytorch_model_fsdp_0, {folder}/optimizer_0\n"))
    result = run_cli("inspect", folder.parent)
    assert result.stderr == (f"ckptctl: error: {folder.parent}: no .metadata file (not a DCP checkpoint?); "
                             f"checkpoints inside: {folder}\n")


@pytest.mark.full
def test_accelerate_save_state_folder_resharded_to_one_rank(tmp_path: Path) -> None:
    """accelerate's `save_state` layout (`random_states_<i>.pkl`, `scheduler.bin`) at 1 rank: refused
    by default; with `--keep-common-ranks` rank 0's random states follow, and accelerate's loaders
    read both parts, the scheduler and rank 0's torch RNG state as saved, bit for bit."""
    ref = run_ranks(tf.save, 2, str(tmp_path), "accelerate", timeout=240)[0]
    folder = tmp_path / tf.FOLDERS["accelerate"]
    refused = run_cli("reshard", folder, tmp_path / "ws1", "-n", 1)
    assert refused.stderr == (
        "ckptctl: error: random_states_{0..1}.pkl: accelerate's RNG state of 2 ranks cannot follow a reshard to 1 "
        "(each process loads its own file); pass --exclude 'random_states_*.pkl' to drop it (the resumed job keeps "
        "the random streams it seeds itself) or --keep-common-ranks to keep the files of the ranks both sizes "
        "have\n")
    result = run_cli("reshard", folder, tmp_path / "ws1", "-n", 1, "--keep-common-ranks", "--json")
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["dropped"] == ["random_states_1.pkl"]
    assert sorted(os.listdir(tmp_path / "ws1")) == ["optimizer_0", "pytorch_model_fsdp_0", "random_states_0.pkl",
                                                   "scheduler.bin"]
    for name in ("random_states_0.pkl", "scheduler.bin"):
        assert (tmp_path / "ws1" / name).read_bytes() == (folder / name).read_bytes()
    got = run_ranks(tf.load, 1, str(tmp_path / "ws1"), timeout=240)[0]
    _assert_same_state(got, ref)
    assert got["scheduler"]["last_epoch"] == 1 and got["scheduler"]["_last_lr"] == [0.005]
    assert torch.equal(got["rng"], torch.manual_seed(100).get_state())  # rank 0's, as saved


def test_dataloader_state_files_are_named_and_bound_to_the_world_size(tmp_path: Path) -> None:
    """accelerate's `dl_state_dict.bin` / `dl_state_dict_<i>.bin` (by name: nothing is unpickled)
    take the world size of the folder's per-rank files, else of the model part's data files."""
    from ckptctl.core.rank_state import rank_files
    from ckptctl.storage.trainer_folder import trainer_folder

    [rng, loaders] = rank_files(["dl_state_dict_1.bin", "random_states_1.pkl", "dl_state_dict.bin",
                                 "random_states_0.pkl", "dl_state_dict_01.bin", "scheduler.bin"])
    assert (rng.names, rng.shared) == (("random_states_0.pkl", "random_states_1.pkl"), False)
    assert (loaders.kind, loaders.names, loaders.ranks, loaders.glob, loaders.shared, loaders.shown) == (
        "accelerate's dataloader state", ("dl_state_dict.bin", "dl_state_dict_1.bin"), 2, "dl_state_dict*.bin", True,
        "dl_state_dict.bin, dl_state_dict_1.bin")
    [alone] = rank_files(["dl_state_dict.bin"], lambda: 3)
    assert alone.ranks == 3
    part = tmp_path / "checkpoint_0" / "pytorch_model_fsdp_0"
    part.mkdir(parents=True)
    for name in (".metadata", "__0_0.distcp", "__1_0.distcp", "__2_0.distcp", "dl_state_dict.bin"):
        (part / name).write_bytes(b"")
    (part.parent / "dl_state_dict.bin").write_bytes(b"")
    [found] = trainer_folder(part.parent).rank_files
    assert (found.names, found.ranks) == (("dl_state_dict.bin",), 3)
    (part / "__2_0.distcp").unlink()
    (part / "__1_0.distcp").unlink()
    (part / "__0_0.distcp").unlink()
    assert trainer_folder(part.parent).rank_files[0].ranks == 0  # not known: kept by no reshard
    refused = run_cli("reshard", part.parent, tmp_path / "o", "-n", 1)
    assert (refused.returncode, refused.stderr) == (2, (
        "ckptctl: error: dl_state_dict.bin: accelerate's dataloader state of a world size not known cannot follow a "
        "reshard to 1 (one file every process loads, its data position counted per process); pass --exclude "
        "'dl_state_dict*.bin' to drop it (the resumed job starts its data order afresh)\n"))


@pytest.mark.full
def test_accelerate_dataloader_state_follows_a_reshard_to_its_own_world_size_only(tmp_path: Path) -> None:
    """accelerate's `save_state` with a stateful data loader at 2 ranks, 3 batches in: `inspect`
    names `dl_state_dict.bin`; a reshard to 1 rank refuses it by default and with
    `--keep-common-ranks` (one file every process loads: loaded at 1 process it resumes at sample
    6, whose batches the 2 ranks had taken), drops it when asked (the loader starts afresh);
    at 2 ranks it is copied byte for byte and accelerate's loader resumes where it stopped."""
    ref = run_ranks(tf.save, 2, str(tmp_path), "accelerate", None, True, timeout=240)[0]
    assert ref["next_batches"] == [[12, 13], [14, 15]]
    folder = tmp_path / tf.FOLDERS["accelerate"]
    lines = run_cli("inspect", folder).stdout.splitlines()
    assert lines[4:6] == [
        "Per-rank files     random_states_{0..1}.pkl: accelerate's RNG state of 2 ranks, kept by a reshard to 2 ranks "
        "only (--exclude 'random_states_*.pkl' drops it)",
        "Per-rank files     dl_state_dict.bin: accelerate's dataloader state of 2 ranks (one file every process "
        "loads), kept by a reshard to 2 ranks only (--exclude 'dl_state_dict*.bin' drops it)"]
    doc = json.loads(run_cli("inspect", folder, "--json").stdout)
    assert doc["rank_files"][1] == {"kind": "accelerate's dataloader state", "files": ["dl_state_dict.bin"],
                                    "ranks": 2, "exclude": "dl_state_dict*.bin", "shared": True}
    refused = run_cli("reshard", folder, tmp_path / "ws1", "-n", 1, "--exclude", "random_states_*.pkl")
    assert (refused.returncode, refused.stderr) == (2, (
        "ckptctl: error: dl_state_dict.bin: accelerate's dataloader state of 2 ranks cannot follow a reshard to 1 "
        "(one file every process loads, its data position counted per process); pass --exclude 'dl_state_dict*.bin' "
        "to drop it (the resumed job starts its data order afresh)\n"))
    common = run_cli("reshard", folder, tmp_path / "ws1", "-n", 1, "--keep-common-ranks")
    assert (common.returncode, common.stderr) == (2, (
        "ckptctl: error: dl_state_dict.bin: accelerate's dataloader state is one file every process loads, its data "
        "position counted per process at the saved world size: no rank's share in it to keep; pass --exclude "
        "'dl_state_dict*.bin' to drop it\n"))
    assert not (tmp_path / "ws1").exists()
    result = run_cli("reshard", folder, tmp_path / "ws1", "-n", 1, "--keep-common-ranks", "--exclude",
                     "dl_state_dict*.bin", "--json")
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["dropped"] == ["dl_state_dict.bin", "random_states_1.pkl"]
    assert run_ranks(tf.load, 1, str(tmp_path / "ws1"), timeout=240)[0]["next_batches"] == [[0, 1]]  # afresh
    kept = tmp_path / "kept"  # what keeping it would do: a position counted for 2 processes, read by 1
    shutil.copytree(tmp_path / "ws1", kept)
    shutil.copy(folder / "dl_state_dict.bin", kept)
    assert run_ranks(tf.load, 1, str(kept), timeout=240)[0]["next_batches"] == [[6, 7]]
    same = run_cli("reshard", folder, tmp_path / "ws2", "-n", 2)
    assert same.returncode == 0, same.stderr
    assert (tmp_path / "ws2" / "dl_state_dict.bin").read_bytes() == (folder / "dl_state_dict.bin").read_bytes()
    got = run_ranks(tf.load, 2, str(tmp_path / "ws2"), timeout=240)[0]
    _assert_same_state(got, ref)
    assert got["next_batches"] == ref["next_batches"]


@pytest.mark.full
def test_export_hf_reads_the_model_part(tmp_path: Path) -> None:
    """A tiny Llama trained one step under FSDP2 and saved by accelerate: export-hf of the folder
    writes the weights transformers' own state dict holds, bit for bit."""
    from safetensors.torch import load_file

    hf = tiny_llama_folder(tmp_path / "hf", 2)
    ref = run_ranks(tf.save, 2, str(tmp_path), "trainer", str(hf), timeout=240)[0]
    folder = tmp_path / tf.FOLDERS["trainer"]
    result = run_cli("export-hf", folder, tmp_path / "out", "--hf-config", hf, "--verify")
    assert result.returncode == 0, result.stderr
    got = load_file(tmp_path / "out" / "model.safetensors")
    assert got.keys() == ref["model"].keys()
    assert all(torch.equal(got[name], value) for name, value in ref["model"].items())
