"""`export-hf --layout distributed -n N`: each rank's shard files of every model file, as torch's
`HuggingFaceStorageWriter(save_distributed=True)` writes them from FSDP2, proven by torch's own code.

The source is the committed FSDP2 save `fsdp2_4ranks` (8 tensors, `head` of 2 rows: at 3 ranks
the third rank's pieces of it are empty), exported with `--arch raw` into 4 model files
(`--max-shard-size 300`). torch's `HuggingFaceStorageReader` loads the output; its
`consolidate_safetensors_files` rebuilds the plain export's files, data bytes and all; its own
writer, given the same tensors as FSDP2 `Shard(0)` DTensors on 3 gloo ranks, writes the same
files; ckptctl reads the folder back, and its check refuses a damaged one.
"""

from __future__ import annotations

import json
import shutil
import struct
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors import safe_open
from torch.distributed.checkpoint._consolidate_hf_safetensors import consolidate_safetensors_files
from torch.distributed.checkpoint.hf_storage import HuggingFaceStorageReader, HuggingFaceStorageWriter

from ckptctl.checks.distributed_output import check_distributed_safetensors
from ckptctl.commands.export_hf import ExportOptions, plan_export
from ckptctl.families.base import load_hf_config
from ckptctl.formats.dcp.metadata import open_checkpoint
from ckptctl.util.errors import CheckpointError
from fixtures.gloo import run_ranks
from fixtures.make_fixtures import load_with_torch
from tests.conftest import FIXTURES, run_cli
from tests.formats.torch_hf import torch_hf_read

SRC = FIXTURES / "fsdp2_4ranks"
SHARD = "shard-{:05}-model-{:05}-of-00004.safetensors"
EXPORT = ("--arch", "raw", "--no-name-check", "--max-shard-size", "300")
RUNS = {"n1": ("-n", "1"), "n3": ("-n", "3"), "n3bf16": ("-n", "3", "--dtype", "bf16")}


@pytest.fixture(scope="module")
def out(tmp_path_factory) -> Path:
    """The plain export (`plain`) and the distributed ones of `RUNS`, each with --verify."""
    root = tmp_path_factory.mktemp("export_distributed")
    (root / "ref").mkdir()
    (root / "ref" / "config.json").write_text('{"model_type": "raw"}')
    for name, extra in {"plain": (), **{k: ("--layout", "distributed", *v) for k, v in RUNS.items()}}.items():
        res = run_cli("export-hf", SRC, root / name, "--hf-config", root / "ref", *EXPORT, *extra, "--verify")
        assert res.returncode == 0, res.stderr
    return root


@pytest.fixture(scope="module")
def source() -> dict[str, torch.Tensor]:
    """The source's model tensors as torch's own offline loader gives them."""
    return load_with_torch(SRC)["model"]


def _header(path: Path) -> tuple[list, int]:
    """A safetensors file's header as (name, entry) pairs in file order, and where its data starts."""
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8:8 + n], object_pairs_hook=list), 8 + n


def _assert_exact(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(want)
    for k, v in want.items():
        assert got[k].dtype == v.dtype and got[k].shape == v.shape and torch.equal(got[k], v), k


def _plain_order(plain: Path) -> dict[str, int]:
    """Each tensor's model file index, in a plain export's order (file by file, header order)."""
    order = {}
    for index, file in enumerate(sorted(plain.glob("*.safetensors")), 1):
        header, _ = _header(file)
        order.update({name: index for name, _ in header if name != "__metadata__"})
    return order


def test_each_rank_writes_its_file_of_each_model_file_and_no_index(out) -> None:
    names = sorted(p.name for p in (out / "n3").iterdir())
    assert names == ["config.json"] + [SHARD.format(r, i) for r in (1, 2, 3) for i in (1, 2, 3, 4)]
    header, _ = _header(out / "n3" / SHARD.format(3, 4))
    metadata = dict(header[0][1])
    assert sorted(metadata) == ["DCP_SHARDING_INFO", "DCP_VERSION", "format"]
    assert (metadata["format"], metadata["DCP_VERSION"]) == ("pt", "1.0")
    assert metadata["DCP_SHARDING_INFO"] == (
        '{"head.bias": {"saved_offsets": [2]}, "head.weight": {"saved_offsets": [2, 0]}, '
        '"mlp.fc1.bias": {"saved_offsets": [8]}, "mlp.fc2.bias": {"saved_offsets": [6]}, '
        '"norm.weight": {"saved_offsets": [6]}}')
    assert [(k, dict(v)["shape"]) for k, v in header[1:]] == [
        ("head.bias", [0]), ("head.weight", [0, 8]), ("mlp.fc1.bias", [4]), ("mlp.fc2.bias", [2]),
        ("norm.weight", [2])]


@pytest.mark.parametrize("run", sorted(RUNS))
def test_torchs_hf_reader_loads_every_tensor_bit_for_bit(out, source, run) -> None:
    want = {k: v.to(torch.bfloat16) if run.endswith("bf16") else v for k, v in source.items()}
    _assert_exact(torch_hf_read(out / run), want)


@pytest.mark.parametrize("run", ["n3", "n3bf16"])
def test_torchs_consolidation_gives_the_plain_exports_files(out, tmp_path, run) -> None:
    """The mapping a user reads off the shard file names (model file index per tensor), in the plain
    export's order: each consolidated file holds the plain file's tensors, its data bytes those bytes."""
    plain = out / "plain"
    if run.endswith("bf16"):
        plain = tmp_path / "plain_bf16"
        res = run_cli("export-hf", SRC, plain, "--hf-config", out / "ref", *EXPORT, "--dtype", "bf16")
        assert res.returncode == 0, res.stderr
    by_name = {}
    for file in sorted((out / run).glob("shard-*.safetensors")):
        with safe_open(file, framework="pt") as f:
            by_name.update({k: int(file.name.split("-")[3]) for k in f.keys()})
    mapping = {k: by_name[k] for k in _plain_order(plain)}
    (tmp_path / "torch").mkdir()  # torch's consolidation writes into a folder that exists
    consolidate_safetensors_files(str(out / run), str(tmp_path / "torch"), mapping)
    names = sorted(p.name for p in plain.glob("*.safetensors"))
    assert names == sorted(p.name for p in (tmp_path / "torch").glob("*.safetensors"))
    for name in names:
        (ours, ours_at), (theirs, theirs_at) = _header(plain / name), _header(tmp_path / "torch" / name)
        assert [(k, dict(v)) for k, v in ours if k != "__metadata__"] == [(k, dict(v)) for k, v in theirs]
        assert (plain / name).read_bytes()[ours_at:] == (tmp_path / "torch" / name).read_bytes()[theirs_at:]
    ours_index = json.loads((plain / "model.safetensors.index.json").read_text())
    theirs_index = json.loads((tmp_path / "torch" / "model.safetensors.index.json").read_text())
    assert ours_index["weight_map"] == theirs_index["weight_map"]
    assert ours_index["metadata"]["total_size"] == theirs_index["metadata"]["total_size"]


def _torch_save(rank: int, world_size: int, out: str, mapping: dict[str, int], full: dict) -> None:
    """torch's own writer of the tensors as FSDP2 holds them: `Shard(0)` DTensors over all ranks."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world_size,))
    state = {k: distribute_tensor(v, mesh, [Shard(0)]) for k, v in full.items()}
    dcp.save(state, storage_writer=HuggingFaceStorageWriter(out, fqn_to_index_mapping=mapping,
                                                            save_distributed=True))


def test_the_files_are_torchs_own_writers(out, source, tmp_path) -> None:
    """Byte for byte but for the order of `__metadata__`'s keys, which safetensors' Rust writer
    takes from a hash map (it varies from process to process)."""
    mapping = _plain_order(out / "plain")
    run_ranks(_torch_save, 3, str(tmp_path / "torch"), mapping, {k: source[k] for k in mapping})
    written = sorted(p.name for p in (out / "n3").glob("*.safetensors"))
    assert written == sorted(p.name for p in (tmp_path / "torch").iterdir())
    for name in written:
        (ours, ours_at), (theirs, theirs_at) = _header(out / "n3" / name), _header(tmp_path / "torch" / name)
        assert ours_at == theirs_at, name
        assert dict(ours[0][1]) == dict(theirs[0][1]), name
        assert ours[1:] == theirs[1:], name
        assert (out / "n3" / name).read_bytes()[ours_at:] == (tmp_path / "torch" / name).read_bytes()[theirs_at:]


def test_ckptctl_reads_the_folder_back(out) -> None:
    """Its pieces are the ones torch's reader finds: FSDP2's `torch.chunk` rows, an empty one at the end."""
    ckpt = open_checkpoint(out / "n3")
    assert (ckpt.saved_world_size, ckpt.version) == (3, "1.0")
    boxes = {fqn: sorted(e.boxes()) for fqn, e in ckpt.tensors.items()}
    md = HuggingFaceStorageReader(str(out / "n3")).read_metadata()
    assert boxes == {k: sorted((tuple(c.offsets), tuple(c.sizes)) for c in v.chunks)
                     for k, v in md.state_dict_metadata.items()}
    assert boxes["embed.weight"] == [((0, 0), (4, 8)), ((4, 0), (4, 8)), ((8, 0), (2, 8))]
    assert boxes["head.weight"] == [((0, 0), (1, 8)), ((1, 0), (1, 8)), ((2, 0), (0, 8))]
    res = run_cli("inspect", "--check", out / "n3")
    assert (res.returncode, res.stdout, res.stderr) == (0, "ok: 8 tensors complete and consistent\n", "")


def _rewrite(file: Path, edit) -> None:
    """Rewrite a file's header (its JSON object `edit`ed in place); the data bytes stay."""
    raw = file.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    edit(header)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    file.write_bytes(struct.pack("<Q", len(text)) + text + raw[8 + n:])


def _offsets(name: str, offsets: list[int]):
    def edit(header: dict) -> None:
        info = json.loads(header["__metadata__"]["DCP_SHARDING_INFO"])
        info[name]["saved_offsets"] = offsets
        header["__metadata__"]["DCP_SHARDING_INFO"] = json.dumps(info)
    return edit


def _flip_first_byte(file: Path) -> None:
    _, at = _header(file)
    raw = bytearray(file.read_bytes())
    raw[at] ^= 0x40
    file.write_bytes(bytes(raw))


@pytest.mark.parametrize("file, damage, line", [
    (SHARD.format(2, 3), lambda f: _rewrite(f, _offsets("mlp.fc2.weight", [0, 0])),
     "{file}: cannot be read back (its DCP_SHARDING_INFO gives other offsets than planned)"),
    (SHARD.format(3, 1), lambda f: _rewrite(f, lambda h: h["__metadata__"].update(DCP_VERSION="2.0")),
     "{file}: cannot be read back (its header metadata lacks format=pt or DCP_VERSION=1.0)"),
    (SHARD.format(1, 1), lambda f: _rewrite(f, lambda h: h.pop("embed.weight")),
     "{file}: cannot be read back (its header names other tensors than planned)"),
    (SHARD.format(1, 1), _flip_first_byte, "{folder}: embed.weight: element [0, 0] of [10, 8] differs from the "
                                           "source's"),
])
def test_the_output_check_refuses_a_damaged_folder(out, tmp_path, file, damage, line) -> None:
    folder = tmp_path / "damaged"
    shutil.copytree(out / "n3", folder)
    damage(folder / file)
    ckpt = open_checkpoint(SRC)
    opts = ExportOptions(arch="raw", name_check=False, max_shard_size=300, layout="distributed", world_size=3)
    plan = plan_export(ckpt, load_hf_config(out / "ref"), opts)
    check_distributed_safetensors(ckpt, out / "n3", plan.shards, plan.targets, plan.sources)  # the intact one passes
    with pytest.raises(CheckpointError) as exc:
        check_distributed_safetensors(ckpt, folder, plan.shards, plan.targets, plan.sources)
    assert str(exc.value) == line.format(file=folder / file, folder=folder)


@pytest.mark.parametrize("extra, line", [
    (("--layout", "distributed"),
     "--layout distributed needs --world-size (the number of ranks whose shard files are written)"),
    (("--layout", "distributed", "-n", "0"), "--world-size must be at least 1 (got 0)"),
    (("-n", "2"), "--world-size applies to --layout distributed only (a model folder is not split by rank)"),
    (("--layout", "torch"), "--layout must be one of hf, distributed (got 'torch')"),
    (("--layout", "distributed", "-n", "2", "--adapter-only"),
     "--adapter-only writes a PEFT adapter folder, which has no --layout distributed"),
    (("--layout", "distributed", "-n", "2", "--merge-adapters"),
     "--merge-adapters computes each merged weight whole, not a rank's rows of it: export merged with --layout hf"),
])
def test_what_the_layout_cannot_honour_is_refused(out, tmp_path, extra, line) -> None:
    res = run_cli("export-hf", SRC, tmp_path / "dst", "--hf-config", out / "ref", *EXPORT, *extra)
    assert (res.returncode, res.stdout, res.stderr) == (2, "", f"ckptctl: error: {line}\n")
    assert not (tmp_path / "dst").exists()


def test_a_0d_tensor_is_rank_1s_and_an_empty_one_every_ranks(out, tmp_path) -> None:
    """As DCP saves them from FSDP2: a 0-d tensor (a buffer FSDP2 leaves whole) once, a tensor of 0
    rows as an empty piece of every rank; torch's reader loads both."""
    state = {"model.w": torch.arange(12.0).reshape(4, 3), "model.scale": torch.tensor(3.25),
             "model.e": torch.zeros(0, 3)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(state, checkpoint_id=tmp_path / "src", no_dist=True)
    res = run_cli("export-hf", tmp_path / "src", tmp_path / "dst", "--hf-config", out / "ref", "--arch", "raw",
                  "--no-name-check", "--layout", "distributed", "-n", "3", "--verify")
    assert res.returncode == 0, res.stderr
    boxes = {fqn: sorted(e.boxes()) for fqn, e in open_checkpoint(tmp_path / "dst").tensors.items()}
    assert boxes == {"e": [((0, 0), (0, 3))] * 3, "scale": [((), ())],
                     "w": [((0, 0), (2, 3)), ((2, 0), (2, 3)), ((4, 0), (0, 3))]}
    with safe_open(tmp_path / "dst" / "shard-00001-model-00001-of-00001.safetensors", framework="pt") as f:
        assert sorted(f.keys()) == ["e", "scale", "w"]
    _assert_exact(torch_hf_read(tmp_path / "dst"), {k.removeprefix("model."): v for k, v in state.items()})


def test_dry_run_lists_the_rank_files_the_export_writes(out, tmp_path) -> None:
    args = ("export-hf", SRC, tmp_path / "dst", "--hf-config", out / "ref", "--arch", "raw", "--no-name-check",
            "--layout", "distributed", "-n", "2")
    res = run_cli(*args, "--dry-run")
    assert res.returncode == 0, res.stderr
    assert res.stdout.splitlines()[:5] == [
        f"dry run: nothing written to {tmp_path / 'dst'}",
        "raw, float32: 8 tensors (318 parameters), 3272 bytes in 2 safetensors files",
        "shard-00001-model-00001-of-00001.safetensors  1636 bytes  8 tensors",
        "shard-00002-model-00001-of-00001.safetensors  1636 bytes  8 tensors",
        "also config.json"]
    assert run_cli(*args).returncode == 0
    assert sorted((p.name, p.stat().st_size) for p in (tmp_path / "dst").glob("*.safetensors")) == [
        ("shard-00001-model-00001-of-00001.safetensors", 1636), ("shard-00002-model-00001-of-00001.safetensors", 1636)]
