"""A folder torch's `HuggingFaceStorageWriter(save_distributed=True)` wrote is a source of every command.

The folders are written by torch's own writer from FSDP2 `Shard(0)` DTensors on 2 and 3 gloo
ranks (a tensor with fewer rows than ranks, a 1-D one, bf16, and a 0-d buffer, which FSDP2
leaves a plain tensor), and every result is checked by torch's own code: its
`HuggingFaceStorageReader`, `dcp.load` of the reshard, `consolidate_safetensors_files` against
export-hf.
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

from ckptctl.util.errors import CheckpointError
from ckptctl.formats.dcp.items import ItemReader
from ckptctl.formats.dcp.metadata import open_checkpoint
from fixtures.gloo import run_ranks
from tests.conftest import run_cli
from tests.formats.torch_hf import torch_hf_read

SHARD = "shard-{:05}-model-00001-of-00001.safetensors"


class Model(torch.nn.Module):
    """Every shape the brief names: rows fewer than ranks (`few` at 3, `one` at 2), 1-D, bf16, 0-d."""

    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.w = torch.nn.Parameter(torch.randn(7, 5, generator=g))
        self.few = torch.nn.Parameter(torch.randn(2, 4, generator=g))
        self.one = torch.nn.Parameter(torch.randn(1, 3, generator=g))
        self.vec = torch.nn.Parameter(torch.randn(11, generator=g))
        self.bf = torch.nn.Parameter(torch.randn(6, 3, generator=g).bfloat16())
        self.register_buffer("scale", torch.tensor(3.25))


EXPECTED = {k: v.detach().clone() for k, v in Model().state_dict().items()}


def _sharded(world_size: int) -> dict:
    from torch.distributed.fsdp import fully_shard

    warnings.simplefilter("ignore")
    model = Model()
    fully_shard(model)
    assert world_size < 2 or type(model.state_dict()["w"]).__name__ == "DTensor"
    return model.state_dict()


def _save(rank: int, world_size: int, out: str, load_from: str | None) -> dict | None:
    """Save the FSDP2 model with torch's HF writer; then, given `load_from`, load that DCP
    checkpoint into a zeroed model with `dcp.load` and return its full tensors."""
    sd = _sharded(world_size)
    dcp.save(sd, storage_writer=HuggingFaceStorageWriter(out, save_distributed=True))
    if load_from is None:
        return None
    with torch.no_grad():
        for value in sd.values():
            value.zero_()
    dcp.load(sd, checkpoint_id=load_from)
    return {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).clone() for k, v in sd.items()}


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> dict:
    """HF3 (3 ranks), its reshard to 2 by the CLI, then HF2 (2 ranks) and `dcp.load` of that reshard at 2."""
    root = tmp_path_factory.mktemp("hf_distributed")
    run_ranks(_save, 3, str(root / "hf3"), None)
    res = run_cli("reshard", root / "hf3", root / "r2", "--world-size", "2", "--verify")
    assert res.returncode == 0, res.stderr
    loaded = run_ranks(_save, 2, str(root / "hf2"), str(root / "r2"))[0]
    return {"root": root, "hf3": root / "hf3", "hf2": root / "hf2", "loaded_r2": loaded}


def _assemble(folder: Path) -> dict[str, torch.Tensor]:
    ckpt = open_checkpoint(folder)
    out = {}
    with ItemReader(ckpt) as reader:
        for fqn, entry in ckpt.tensors.items():
            out[fqn] = torch.zeros(entry.shape, dtype=entry.dtype.torch)
            for chunk in entry.chunks:
                if chunk.numel:
                    out[fqn][tuple(slice(o, o + s) for o, s in zip(chunk.offsets, chunk.sizes))] = \
                        reader.read_chunk(entry, chunk)
    return out


def _assert_exact(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(want)
    for k, v in want.items():
        assert got[k].dtype == v.dtype and got[k].shape == v.shape and torch.equal(got[k], v), k


@pytest.mark.parametrize("name", ["hf3", "hf2"])
def test_pieces_are_chunks_at_the_offsets_torch_recorded(saved, name) -> None:
    ckpt = open_checkpoint(saved[name])
    ranks = int(name[2:])
    assert ckpt.saved_world_size == ranks and ckpt.version == "1.0"
    assert list(ckpt.files) == [SHARD.format(r + 1) for r in range(ranks)]
    boxes = {fqn: sorted(e.boxes()) for fqn, e in ckpt.tensors.items()}
    md = HuggingFaceStorageReader(str(saved[name])).read_metadata()
    assert boxes == {k: sorted((tuple(c.offsets), tuple(c.sizes)) for c in v.chunks)
                     for k, v in md.state_dict_metadata.items()}
    if ranks == 3:
        assert boxes["few"] == [((0, 0), (1, 4)), ((1, 0), (1, 4)), ((2, 0), (0, 4))]
        assert boxes["w"] == [((0, 0), (3, 5)), ((3, 0), (3, 5)), ((6, 0), (1, 5))]
    else:
        assert boxes["one"] == [((0, 0), (1, 3)), ((1, 0), (0, 3))]
    assert boxes["scale"] == [((), ())]
    got = _assemble(saved[name])
    _assert_exact(got, EXPECTED)
    _assert_exact(got, torch_hf_read(saved[name]))


@pytest.mark.parametrize("name", ["hf3", "hf2"])
def test_inspect_check_is_clean(saved, name) -> None:
    res = run_cli("inspect", "--check", saved[name])
    assert (res.returncode, res.stdout, res.stderr) == (0, "ok: 6 tensors complete and consistent\n", "")


def test_reshard_3_to_2_is_loaded_by_dcp_load_into_fsdp2(saved) -> None:
    _assert_exact(saved["loaded_r2"], EXPECTED)


def test_reshard_2_to_3_is_loaded_by_dcp_load(saved, tmp_path) -> None:
    res = run_cli("reshard", saved["hf2"], tmp_path / "r3", "--world-size", "3")
    assert res.returncode == 0, res.stderr
    assert open_checkpoint(tmp_path / "r3").saved_world_size == 3
    out = {k: torch.zeros_like(v) for k, v in EXPECTED.items()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(out, checkpoint_id=tmp_path / "r3", no_dist=True)
    _assert_exact(out, EXPECTED)
    res = run_cli("diff", saved["hf2"], tmp_path / "r3")
    assert (res.returncode, res.stdout) == (0, "6 tensors: 6 equal, 0 close, 0 differs\n")


def test_export_hf_equals_torchs_consolidation(saved, tmp_path) -> None:
    """Tensor by tensor, but for the 0-d one: torch 2.13's consolidation writes a 0-d tensor's
    bytes as zeros (`_write_sub_tensor_to_file_optimized` returns early for an empty shape); ours
    is what torch's HF reader loads."""
    ref = tmp_path / "ref"
    ref.mkdir()
    (ref / "config.json").write_text('{"model_type": "raw"}')
    res = run_cli("export-hf", saved["hf3"], tmp_path / "ours", "--hf-config", ref, "--arch", "raw",
                  "--no-name-check", "--verify")
    assert res.returncode == 0, res.stderr
    (tmp_path / "torch").mkdir()
    consolidate_safetensors_files(str(saved["hf3"]), str(tmp_path / "torch"), {k: 1 for k in EXPECTED})
    ours, theirs = _read_folder(tmp_path / "ours"), _read_folder(tmp_path / "torch")
    assert sorted(ours) == sorted(theirs)
    _assert_exact({k: v for k, v in ours.items() if v.dim()}, {k: v for k, v in theirs.items() if v.dim()})
    _assert_exact(ours, torch_hf_read(saved["hf3"]))
    _assert_exact(ours, EXPECTED)


def test_export_torch_holds_every_tensor(saved, tmp_path) -> None:
    res = run_cli("export-torch", saved["hf3"], tmp_path / "out.pt")
    assert res.returncode == 0, res.stderr
    _assert_exact(torch.load(tmp_path / "out.pt", weights_only=True), EXPECTED)


def _read_folder(folder: Path) -> dict[str, torch.Tensor]:
    out = {}
    for file in sorted(folder.glob("*.safetensors")):
        with safe_open(file, framework="pt") as f:
            out.update({k: f.get_tensor(k) for k in f.keys()})
    return out


# --------------------------------------------------------------------------------------
# Hostile and broken folders: one line each, naming the file and the problem
# --------------------------------------------------------------------------------------


def _rewrite(file: Path, edit) -> None:
    """Rewrite the file's header (its JSON object, `edit`ed in place); the data bytes stay."""
    raw = file.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    edit(header)
    text = json.dumps(header).encode()
    file.write_bytes(struct.pack("<Q", len(text)) + text + raw[8 + n:])


def _sharding(offsets: dict[str, list[int]]):
    def edit(header: dict) -> None:
        info = json.loads(header["__metadata__"]["DCP_SHARDING_INFO"])
        for name, value in offsets.items():
            info[name]["saved_offsets"] = value
        header["__metadata__"]["DCP_SHARDING_INFO"] = json.dumps(info)
    return edit


def _metadata(key: str, value: str):
    def edit(header: dict) -> None:
        header["__metadata__"][key] = value
    return edit


@pytest.fixture
def broken(saved, tmp_path):
    """A copy of HF3 with shard `rank + 1`'s header edited."""

    def make(rank: int, edit) -> Path:
        folder = tmp_path / "broken"
        shutil.copytree(saved["hf3"], folder)
        _rewrite(folder / SHARD.format(rank + 1), edit)
        return folder

    return make


@pytest.mark.parametrize("rank, edit, line", [
    (2, _sharding({"w": [5, 0]}), "{2}: w: the piece at [5, 0] of [1, 5] in {2} overlaps the piece at [3, 0] "
                                  "of [3, 5] in {1}"),
    (1, _sharding({"vec": [0]}), "{1}: vec: the piece at [0] of [4] in {1} overlaps the piece at [0] of [4] in {0}"),
    (2, _sharding({"w": [6]}), "{2}: w: saved_offsets [6] are not 2 offsets >= 0 for its shape [1, 5]"),
    (2, _sharding({"w": [-1, 0]}), "{2}: w: saved_offsets [-1, 0] are not 2 offsets >= 0 for its shape [1, 5]"),
    (2, _sharding({"w": [1 << 49, 0]}), "w: implausible extent [562949953421313, 5] of its pieces"),
    (0, _metadata("DCP_SHARDING_INFO", '{"w": {"saved_offsets": [0, 0]'),
     "{0}: DCP_SHARDING_INFO in __metadata__ is not JSON (Expecting ',' delimiter: line 1 column 31 (char 30))"),
    (1, _metadata("DCP_SHARDING_INFO", "[]"), "{1}: DCP_SHARDING_INFO in __metadata__ is not a JSON object"),
    (1, _metadata("DCP_SHARDING_INFO", '{"w": {"saved_offsets": [3, 0]}}'),
     "{1}: few: no saved_offsets in DCP_SHARDING_INFO"),
    (1, lambda h: h["__metadata__"].pop("DCP_SHARDING_INFO"),
     "{1}: no DCP_SHARDING_INFO in its __metadata__, unlike {0}"),
    (2, _metadata("DCP_VERSION", "9"), "{2}: DCP_VERSION '9' in __metadata__, '1.0' in {0}"),
])
def test_a_broken_piece_is_one_line(broken, rank, edit, line) -> None:
    folder = broken(rank, edit)
    want = line.format(*(SHARD.format(r + 1) for r in range(3)))
    want = f"{folder}/{want}" if want.startswith("shard-") else f"{folder}: {want}"
    with pytest.raises(CheckpointError) as exc:
        open_checkpoint(folder)
    assert str(exc.value) == want


def test_overlapping_pieces_are_refused_by_every_command(broken, tmp_path) -> None:
    folder = broken(2, _sharding({"w": [5, 0]}))
    line = (f"ckptctl: error: {folder}/{SHARD.format(3)}: w: the piece at [5, 0] of [1, 5] in {SHARD.format(3)} "
            f"overlaps the piece at [3, 0] of [3, 5] in {SHARD.format(2)}\n")
    for args in (("inspect", folder), ("reshard", folder, tmp_path / "out", "--world-size", "2")):
        res = run_cli(*args)
        assert (res.returncode, res.stdout, res.stderr) == (2, "", line), args
    assert not (tmp_path / "out").exists()


def test_offsets_past_the_other_pieces_leave_a_gap_reported_as_for_dcp(broken, tmp_path) -> None:
    """No global shape is recorded: a piece placed past the others makes the tensor longer, with
    rows no file holds; coverage names them as for any DCP checkpoint."""
    folder = broken(2, _sharding({"w": [9, 0]}))
    res = run_cli("inspect", "--check", folder)
    assert (res.returncode, res.stdout) == (1, "w: chunks cover 35 of 50 elements (15 missing)\n")
    res = run_cli("reshard", folder, tmp_path / "out", "--world-size", "2")
    assert (res.returncode, res.stdout, res.stderr) == (
        2, "", f"ckptctl: error: {folder}: refusing incomplete checkpoint: w: chunks cover 35 of 50 elements "
               "(15 missing); pass --allow-incomplete to go on\n")


def test_import_hf_names_a_distributed_save_for_what_it_is(saved, tmp_path) -> None:
    res = run_cli("import-hf", saved["hf3"], tmp_path / "out", "--world-size", "2")
    assert (res.returncode, res.stdout, res.stderr) == (
        2, "", f"ckptctl: error: {saved['hf3']}/{SHARD.format(2)}: few: also in {SHARD.format(1)} (a distributed "
               "save of torch's HuggingFaceStorageWriter: a checkpoint, which reshard turns into DCP)\n")


def test_a_name_the_sharding_info_adds_is_refused(broken) -> None:
    def edit(header: dict) -> None:
        info = json.loads(header["__metadata__"]["DCP_SHARDING_INFO"])
        info["ghost"] = {"saved_offsets": [0]}
        header["__metadata__"]["DCP_SHARDING_INFO"] = json.dumps(info)
    folder = broken(0, edit)
    with pytest.raises(CheckpointError) as exc:
        open_checkpoint(folder)
    assert str(exc.value) == f"{folder}/{SHARD.format(1)}: ghost: in DCP_SHARDING_INFO but not a tensor of this file"


def test_pieces_of_another_dtype_are_refused(broken) -> None:
    def edit(header: dict) -> None:
        header["w"]["dtype"] = "I32"
    folder = broken(1, edit)
    with pytest.raises(CheckpointError) as exc:
        open_checkpoint(folder)
    assert str(exc.value) == f"{folder}/{SHARD.format(2)}: w: int32 here, float32 in {SHARD.format(1)}"


def test_a_rank_of_several_files_is_read_whole(tmp_path) -> None:
    """`fqn_to_index_mapping` spreads a rank's tensors over `model-{i}-of-{n}` files."""
    sd = {"a": torch.arange(6.0).reshape(2, 3), "b": torch.arange(4, dtype=torch.bfloat16), "c": torch.tensor(7)}
    writer = HuggingFaceStorageWriter(str(tmp_path / "hf"), fqn_to_index_mapping={"a": 1, "b": 2, "c": 2},
                                      save_distributed=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(sd, storage_writer=writer, no_dist=True)
    ckpt = open_checkpoint(tmp_path / "hf")
    assert list(ckpt.files) == ["shard-00001-model-00001-of-00002.safetensors",
                                "shard-00001-model-00002-of-00002.safetensors"]
    assert ckpt.saved_world_size == 1
    _assert_exact(_assemble(tmp_path / "hf"), sd)
