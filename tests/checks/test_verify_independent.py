"""`--verify` decodes the source with torch's own loader, not the reader the copy used.

A copy and a verification that both read the source through ckptctl's item reader would
agree with each other on whatever that reader gets wrong; the decoded-source check reads
each source item with torch instead, so an output element that differs from torch's value
is caught. A big-endian item (`archive/byteorder` = big: torch swaps its bytes on load) is
the case the reader once got wrong: it is now decoded by torch, not copied raw.
"""

from __future__ import annotations

import io
import pickle
import zipfile
from pathlib import Path

import pytest
import torch

from ckptctl.engine.cpu import ChunkSource
from ckptctl.util.errors import CheckpointError
from ckptctl.formats.dcp.items import ItemReader
from ckptctl.formats.dcp.metadata import open_checkpoint
from ckptctl.core.dtypes import as_dtype
from ckptctl.core.geometry import region_bounds
from ckptctl.core.plan import identity_target, source_view
from ckptctl.core.analysis import source_tensors
from ckptctl.commands.reshard import ReshardOptions, plan_reshard
from ckptctl.checks.verify import check_decoded_source, dcp_read_back, decode_source_item
from tests.conftest import run_cli
from tests.test_hostile_input import copy_fixture, real_metadata, snapshot


def big_endian_item(src: Path) -> tuple[str, torch.Tensor]:
    """Re-save rank 0's first item big-endian (appended to its file, metadata pointed at it):
    the tensor torch loads from it is the original's, its raw record bytes are swapped."""
    md = real_metadata(src)
    index, info = min(((k, v) for k, v in md.storage_data.items() if v.relative_path == "__0_0.distcp"),
                      key=lambda kv: kv[1].offset)
    path = src / "__0_0.distcp"
    blob = path.read_bytes()
    item = zipfile.ZipFile(io.BytesIO(blob[info.offset:info.offset + info.length]))
    original = torch.load(io.BytesIO(blob[info.offset:info.offset + info.length]), weights_only=True)
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as swapped:
        for entry in item.infolist():
            data = item.read(entry)
            if entry.filename.endswith("byteorder"):
                data = b"big"
            elif entry.filename.endswith("data/0"):
                data = original.numpy().astype(">f4").tobytes()
            swapped.writestr(entry.filename, data)
    info.offset, info.length = len(blob), len(out.getvalue())
    path.write_bytes(blob + out.getvalue())
    (src / ".metadata").write_bytes(pickle.dumps(md))
    assert torch.equal(torch.load(io.BytesIO(out.getvalue()), weights_only=True), original)
    return index.fqn, original


def test_a_big_endian_item_is_copied_as_its_values_not_its_bytes(tmp_path: Path) -> None:
    src = copy_fixture(tmp_path)
    fqn, original = big_endian_item(src)
    assert run_cli("reshard", src, tmp_path / "dst", "-n", "1", "--verify").returncode == 0
    ckpt = open_checkpoint(tmp_path / "dst")
    chunks = ChunkSource(ckpt)
    try:
        entry = ckpt.tensors[fqn]
        copied = chunks.reader.read_chunk(entry, entry.chunks[0])[: original.shape[0]]
    finally:
        chunks.close()
    assert torch.equal(copied, original)


def test_the_decoded_source_check_catches_an_output_element_the_copy_got_wrong(fixture_ckpt, tmp_path: Path) -> None:
    src, dst = fixture_ckpt("fsdp2_4ranks"), tmp_path / "dst"
    assert run_cli("reshard", src, dst, "-n", "2").returncode == 0
    out = open_checkpoint(dst)
    fqn = "model.mlp.fc1.weight"
    entry = out.tensors[fqn]
    with ItemReader(out) as reader:
        record = reader.locate(entry, entry.chunks[1])
    with open(record.path, "r+b") as f:  # the output's second chunk, first element: one bit flipped
        f.seek(record.byte_offset)
        first = f.read(1)
        f.seek(record.byte_offset)
        f.write(bytes([first[0] ^ 1]))
    ckpt, out = open_checkpoint(src), open_checkpoint(dst)
    out_chunks = ChunkSource(out)
    try:
        sources = {f: source_view(e) for f, e in ckpt.tensors.items()}
        targets = {f: identity_target(sources[f]) for f in out.tensors}
        with pytest.raises(CheckpointError) as caught:
            check_decoded_source(ckpt, targets, sources, dcp_read_back(out, out_chunks), dst)
    finally:
        out_chunks.close()
    chunk = next(c for c in ckpt.tensors[fqn].chunks if c.offsets[0] <= entry.chunks[1].offsets[0] < c.offsets[0] + c.sizes[0])
    assert str(caught.value) == (f"{dst}: {fqn}: verification failed (the chunk at {list(chunk.offsets)} of {fqn}, "
                                 f"decoded by torch from {chunk.file}, differs from the output)")


def planned_check(src: Path, dst: Path, opts: ReshardOptions) -> int:
    """check_decoded_source on `dst` against the plan reshard made of `src` with `opts`."""
    ckpt, out = open_checkpoint(src), open_checkpoint(dst)
    out_chunks = ChunkSource(out)
    try:
        return check_decoded_source(ckpt, plan_reshard(ckpt, opts).targets, source_tensors(ckpt),
                                    dcp_read_back(out, out_chunks), dst)
    finally:
        out_chunks.close()


def flip_first_byte(dst: Path, fqn: str, index: int) -> tuple[int, ...]:
    """Flip one bit of the first element of output chunk `index` of `fqn`; its offsets."""
    out = open_checkpoint(dst)
    entry = out.tensors[fqn]
    with ItemReader(out) as reader:
        record = reader.locate(entry, entry.chunks[index])
    with open(record.path, "r+b") as f:
        f.seek(record.byte_offset)
        first = f.read(1)
        f.seek(record.byte_offset)
        f.write(bytes([first[0] ^ 1]))
    return entry.chunks[index].offsets


@pytest.mark.parametrize("name, args, opts", [
    ("fsdp2_4ranks", ("-n", "3", "--dtype", "bf16"), ReshardOptions(world_size=3, dtype=as_dtype("bfloat16"))),
    ("flat_optim", ("-n", "3", "--dtype", "bf16"), ReshardOptions(world_size=3, dtype=as_dtype("bfloat16"))),
    ("zstd", ("-n", "3"), ReshardOptions(world_size=3)),
    ("megatron_tp2_dp2", ("-n", "2", "--split-fused"), ReshardOptions(world_size=2, split_fused=True)),
])
def test_decoded_source_check_passes_on_a_sound_copy_of_every_fixture(fixture_ckpt, tmp_path: Path, name: str,
                                                                        args: tuple[str, ...],
                                                                        opts: ReshardOptions) -> None:
    src, dst = fixture_ckpt(name), tmp_path / name
    before = snapshot(src)
    assert run_cli("reshard", src, dst, *args).returncode == 0
    ckpt = open_checkpoint(src)
    assert planned_check(src, dst, opts) == sum(1 for e in ckpt.tensors.values() for c in e.chunks if c.numel)
    for entry in ckpt.tensors.values():
        assert decode_source_item(ckpt, entry, entry.chunks[0]).shape == entry.chunks[0].sizes
    assert snapshot(src) == before


def test_the_decoded_source_check_catches_a_wrong_element_of_a_split_fused_tensor(fixture_ckpt,
                                                                                   tmp_path: Path) -> None:
    """A fused SwiGLU fc1 split into gate and up: the check follows each piece back to the
    fused source chunk it came from, so the flipped element is caught there too."""
    src, dst = fixture_ckpt("megatron_tp2_dp2"), tmp_path / "dst"
    assert run_cli("reshard", src, dst, "-n", "2", "--split-fused").returncode == 0
    opts = ReshardOptions(world_size=2, split_fused=True)
    targets = plan_reshard(open_checkpoint(src), opts).targets
    fqn = next(f for f, t in targets.items() if f.endswith("linear_fc1.weight_v.exp_avg") and len(t.pieces) > 1)
    offsets = flip_first_byte(dst, fqn, 1)
    with pytest.raises(CheckpointError) as caught:
        planned_check(src, dst, opts)
    piece = next(p for p in targets[fqn].pieces if p.dst_start[0] <= offsets[0] < p.dst_start[0] + p.sizes[0])
    row = piece.src_start[0] + offsets[0] - piece.dst_start[0]
    source = source_tensors(open_checkpoint(src))[piece.src]
    chunk = next(c for c, r in source.chunks if region_bounds(r, source.shape).offsets[0] <= row
                 < region_bounds(r, source.shape).offsets[0] + region_bounds(r, source.shape).sizes[0])
    assert str(caught.value) == (f"{dst}: {fqn}: verification failed (the chunk at {list(chunk.offsets)} of "
                                 f"{piece.src}, decoded by torch from {chunk.file}, differs from the output)")


def test_torch_decode_of_items_sharing_a_pickle_equals_torch_load() -> None:
    """Items whose data.pkl is byte-identical are decoded as the view torch.load found for the
    first: each must still give its own values, exactly what torch.load gives."""
    from ckptctl.checks.verify import _torch_load

    items = []
    for seed in range(3):
        buf = io.BytesIO()
        torch.save(torch.randn(6, 4, generator=torch.Generator().manual_seed(seed))[1:5, ::2], buf)
        items.append(buf.getvalue())
    for raw in items + items:
        assert torch.equal(_torch_load(raw), torch.load(io.BytesIO(raw), weights_only=True))
