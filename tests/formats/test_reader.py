"""ItemReader returns exactly what torch's own loaders return, for every fixture and format."""

from __future__ import annotations

import argparse
import dataclasses
import os
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.filesystem import SerializationFormat
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from torch.distributed.checkpoint.hf_storage import HuggingFaceStorageReader

from ckptctl.util.errors import CheckpointError
from ckptctl.formats.dcp.items import ItemReader
from ckptctl.formats.dcp.metadata import open_checkpoint
from ckptctl.core.analysis import analysis
from ckptctl.core.checkpoint import Checkpoint, TensorEntry
from tests.conftest import run_cli

FIXTURE_NAMES = ["fsdp2_4ranks", "megatron_tp2_dp2", "flat_optim", "broken_plain_optim", "zstd"]


def assemble(reader: ItemReader, entry: TensorEntry) -> torch.Tensor:
    """The global tensor placed together from its chunks (flat 1-D entries stay 1-D)."""
    out = torch.zeros(entry.shape, dtype=entry.dtype.torch)
    for chunk in entry.chunks:
        if chunk.numel:
            out[tuple(slice(o, o + s) for o, s in zip(chunk.offsets, chunk.sizes))] = reader.read_chunk(entry, chunk)
    return out


def nested(tree: dict[str, Any], path: tuple[str, ...]) -> Any:
    for key in path:
        tree = tree[key]
    return tree


@pytest.fixture(scope="session")
def torch_loaded(fixture_ckpt, tmp_path_factory) -> Any:
    """torch's offline loader (`dcp_to_torch_save` + `torch.load`) per fixture, loaded once."""
    cache: dict[str, dict] = {}

    def get(name: str) -> dict:
        if name not in cache:
            dst = tmp_path_factory.mktemp("torch_save") / f"{name}.pt"
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                dcp_to_torch_save(fixture_ckpt(name), dst)
            cache[name] = torch.load(dst, weights_only=False)
        return cache[name]

    return get


@pytest.mark.parametrize("name", FIXTURE_NAMES)
def test_every_tensor_equals_torchs_loader(name: str, fixture_ckpt, torch_loaded) -> None:
    ckpt = open_checkpoint(fixture_ckpt(name))
    reference = torch_loaded(name)
    assert ckpt.tensors
    with ItemReader(ckpt) as reader:
        for fqn, entry in ckpt.tensors.items():
            expected = nested(reference, ckpt.planner_data[fqn])
            got = assemble(reader, entry)
            assert got.dtype == expected.dtype and torch.equal(got, expected), fqn


@pytest.mark.parametrize("name", FIXTURE_NAMES)
def test_every_bytes_entry_equals_torchs_loader(name: str, fixture_ckpt, torch_loaded) -> None:
    ckpt = open_checkpoint(fixture_ckpt(name))
    reference = torch_loaded(name)
    assert ckpt.bytes_entries
    with ItemReader(ckpt) as reader:
        for fqn, entry in ckpt.bytes_entries.items():
            got = reader.load_bytes_value(entry, safe_globals=[argparse.Namespace])
            assert got == nested(reference, ckpt.planner_data[fqn]), fqn


@pytest.mark.parametrize("name", ["fsdp2_4ranks", "megatron_tp2_dp2", "flat_optim", "broken_plain_optim"])
def test_plain_items_are_located_without_decoding(name: str, fixture_ckpt) -> None:
    """The fast path: every chunk's bytes are one dense run inside its file."""
    ckpt = open_checkpoint(fixture_ckpt(name))
    with ItemReader(ckpt) as reader:
        for entry in ckpt.tensors.values():
            for chunk in entry.chunks:
                record = reader.locate(entry, chunk)
                assert record is not None, entry.fqn
                assert record.nbytes == chunk.numel * entry.itemsize
                assert chunk.offset <= record.byte_offset <= chunk.offset + chunk.length - record.nbytes


def test_zstd_items_are_decoded_through_their_transform(fixture_ckpt) -> None:
    ckpt = open_checkpoint(fixture_ckpt("zstd"))
    with ItemReader(ckpt) as reader:
        chunks = [(e, c) for e in ckpt.tensors.values() for c in e.chunks]
        assert {c.transforms for _, c in chunks} == {("stream.zstd/1",)}
        assert all(reader.locate(e, c) is None for e, c in chunks)


def _save(path: Path, state_dict: dict[str, Any], **writer_kwargs: Any) -> Checkpoint:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(state_dict, storage_writer=FileSystemWriter(path, **writer_kwargs), no_dist=True)
    return open_checkpoint(path)


def test_views_are_read_as_their_values_not_their_storage(tmp_path: Path) -> None:
    """torch.save keeps a view's whole storage with offset and strides; the reader honours them."""
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    sd = {"transposed": base.t(), "narrowed": base[1:3], "column": base[:, 2], "empty": base[:0]}
    ckpt = _save(tmp_path / "views", sd)
    with ItemReader(ckpt) as reader:
        for fqn, value in sd.items():
            assert torch.equal(assemble(reader, ckpt.tensors[fqn]), value), fqn


SAFETENSORS_SD = {
    "w": torch.arange(12, dtype=torch.float32).reshape(3, 4),
    "b": torch.arange(5, dtype=torch.bfloat16),
    "i": torch.arange(6, dtype=torch.int64).reshape(2, 3),
    "step": torch.tensor(2.5),
    "mask": torch.tensor([[True, False], [False, True]]),
    "epoch": 7,
}


@pytest.fixture(scope="session")
def safetensors_ckpt(tmp_path_factory) -> Checkpoint:
    """A SAFETENSORS-format DCP checkpoint: two files, each with bytes items before its blob."""
    return _save(tmp_path_factory.mktemp("st") / "ckpt", SAFETENSORS_SD,
                 serialization_format=SerializationFormat.SAFETENSORS, thread_count=2)


def _hf_reader_reference(ckpt: Checkpoint, workdir: Path) -> dict[str, torch.Tensor]:
    """torch's HuggingFaceStorageReader over each file's safetensors blob (it cannot read .distcp)."""
    blobs = {c.file: c.offset for e in ckpt.tensors.values() for c in e.chunks}
    workdir.mkdir()
    for file, offset in blobs.items():
        (workdir / f"{file}.safetensors").write_bytes((ckpt.path / file).read_bytes()[offset:])
    out = {fqn: torch.full(e.shape, 0, dtype=e.dtype.torch) for fqn, e in ckpt.tensors.items()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(out, storage_reader=HuggingFaceStorageReader(str(workdir)), no_dist=True)
    return out


def test_safetensors_format_items_equal_torchs_hf_reader(safetensors_ckpt: Checkpoint, tmp_path: Path) -> None:
    ckpt = safetensors_ckpt
    assert len(ckpt.files) == 2 and all(b.offset == 0 for b in ckpt.bytes_entries.values())
    reference = _hf_reader_reference(ckpt, tmp_path / "hf")
    with ItemReader(ckpt) as reader:
        for fqn, entry in ckpt.tensors.items():
            assert torch.equal(assemble(reader, entry), reference[fqn]), fqn
            assert torch.equal(reference[fqn], SAFETENSORS_SD[fqn]), fqn
            (chunk,) = entry.chunks
            record = reader.locate(entry, chunk)
            assert record is not None and record.byte_offset > chunk.offset and record.nbytes == chunk.length
        assert reader.load_bytes_value(ckpt.bytes_entries["epoch"]) == 7


def test_safetensors_record_of_another_chunk_is_refused(safetensors_ckpt: Checkpoint) -> None:
    """A record is found by name; its DCP_SHARDING_INFO offsets must be the chunk's."""
    entry = safetensors_ckpt.tensors["w"]
    moved = dataclasses.replace(entry.chunks[0], offsets=(3, 0))
    with ItemReader(safetensors_ckpt) as reader, pytest.raises(CheckpointError, match="chunk at other offsets"):
        reader.read_chunk(dataclasses.replace(entry, shape=(6, 4), chunks=(moved,)), moved)


def _per_rank_save(rank: int, world_size: int, out: str) -> None:
    """Each rank writes its own `__{rank}.metadata` (no collectives): a DTensor shard and a plain tensor."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    warnings.simplefilter("ignore")
    mesh = init_device_mesh("cpu", (world_size,))
    w = distribute_tensor(torch.arange(32, dtype=torch.float32).reshape(4, 8), mesh, [Shard(0)])
    plain = torch.full((rank + 1, 3), float(rank))
    dcp.save({"w": w, "plain": plain, "epoch": rank}, checkpoint_id=out, use_collectives=False)


@pytest.fixture(scope="session")
def per_rank_ckpt(tmp_path_factory) -> Path:
    from fixtures.gloo import run_ranks

    path = tmp_path_factory.mktemp("per_rank") / "ckpt"
    run_ranks(_per_rank_save, 2, str(path))
    return path


def test_per_rank_metadata_files_are_merged(per_rank_ckpt: Path) -> None:
    ckpt = open_checkpoint(per_rank_ckpt)
    assert ckpt.metadata_files == ("__0.metadata", "__1.metadata")
    assert sorted(n for n in os.listdir(per_rank_ckpt) if n.endswith(".metadata")) == list(ckpt.metadata_files)
    with ItemReader(ckpt) as reader:
        assert torch.equal(assemble(reader, ckpt.tensors["w"]), torch.arange(32, dtype=torch.float32).reshape(4, 8))
        # Both ranks saved `plain` at offset 0 (sizes [1, 3] and [2, 3]): rank 0's chunk and item are kept together.
        assert torch.equal(assemble(reader, ckpt.tensors["plain"]), torch.zeros(1, 3))
        assert reader.load_bytes_value(ckpt.bytes_entries["epoch"]) == 0



def test_ranks_that_disagree_about_an_entry_are_a_problem(per_rank_ckpt: Path, tmp_path: Path) -> None:
    """`plain` is [1, 3] on rank 0 and [2, 3] on rank 1: inspect --check names it, reshard refuses it."""
    message = ("plain: ranks saved different tensors under this name ([1, 3] float32 in __0.metadata, "
               "[2, 3] float32 in __1.metadata); only __0.metadata's is read")
    ckpt = open_checkpoint(per_rank_ckpt)
    assert [(p.fqn, p.kind, p.message) for p in analysis(ckpt).problems] == [("plain", "rank-conflict", message)]
    check = run_cli("inspect", per_rank_ckpt, "--check")
    assert check.returncode == 1 and message in check.stdout
    refused = run_cli("reshard", per_rank_ckpt, tmp_path / "o", "-n", "2")
    assert refused.returncode == 2 and message in refused.stderr and not (tmp_path / "o").exists()
    assert run_cli("reshard", per_rank_ckpt, tmp_path / "o", "-n", "2", "--allow-incomplete").returncode == 0
    (tmp_path / "config.json").write_text('{"model_type": "raw"}')
    exported = run_cli("export-hf", per_rank_ckpt, tmp_path / "hf", "--hf-config", tmp_path, "--arch", "raw",
                       "--no-name-check")
    assert exported.returncode == 2 and message in exported.stderr and not (tmp_path / "hf").exists()


@pytest.mark.parametrize("name", ["fsdp2_4ranks", "megatron_tp2_dp2", "megatron_torch_dist", "flat_optim", "zstd",
                                  "broken_plain_optim"])
def test_tensors_checked_a_column_at_a_time_equal_those_checked_chunk_by_chunk(name, fixture_ckpt, monkeypatch):
    """A tensor saved as torch saves one is checked a column at a time; the checkpoint read is the
    one read chunk by chunk (every chunk's file, place and box, the files in the same order)."""
    from ckptctl.formats.dcp import metadata

    fast = open_checkpoint(fixture_ckpt(name))
    taken: list = []  # the tensors asked for, then the tables made
    column = metadata._table_in_order
    monkeypatch.setattr(metadata, "_table_in_order", lambda *args: taken.append(args[1]) or None)
    slow = open_checkpoint(fixture_ckpt(name))
    assert fast.tensors == slow.tensors and fast.files == slow.files
    assert [list(e.chunks) for e in fast.tensors.values()] == [list(e.chunks) for e in slow.tensors.values()]
    monkeypatch.setattr(metadata, "_table_in_order", lambda *args: taken.append(column(*args)))
    open_checkpoint(fixture_ckpt(name))
    assert len(taken) == 2 * len(fast.tensors)
    in_order = [t for t in taken[len(fast.tensors):] if t is not None]
    assert in_order if name != "zstd" else not in_order  # a transformed entry is checked chunk by chunk
