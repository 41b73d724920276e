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
from ckptctl.errors import CheckpointError
from ckptctl.formats.dcp_items import ItemReader
from ckptctl.formats.dcp_metadata import open_checkpoint
from ckptctl.plan import identity_target, source_view
from ckptctl.verify import check_decoded_source, dcp_read_back, decode_source_item
from tests.conftest import run_cli
from tests.test_hostile_input import assert_one_line, copy_fixture, real_metadata, snapshot


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
        targets = {f: identity_target(source_view(e)) for f, e in out.tensors.items()}
        with pytest.raises(CheckpointError) as caught:
            check_decoded_source(ckpt, targets, dcp_read_back(out, out_chunks), dst)
    finally:
        out_chunks.close()
    chunk = next(c for c in ckpt.tensors[fqn].chunks if c.offsets[0] <= entry.chunks[1].offsets[0] < c.offsets[0] + c.sizes[0])
    assert str(caught.value) == (f"{dst}: {fqn}: verification failed (the chunk at {list(chunk.offsets)} of {fqn}, "
                                 f"decoded by torch from {chunk.file}, differs from the output)")


def test_decoded_source_check_passes_on_a_sound_copy_of_every_fixture(fixture_ckpt, tmp_path: Path) -> None:
    for name in ("fsdp2_4ranks", "flat_optim", "zstd"):
        src = fixture_ckpt(name)
        before = snapshot(src)
        dst = tmp_path / name
        assert run_cli("reshard", src, dst, "-n", "3", "--dtype", "bf16").returncode == 0
        ckpt, out = open_checkpoint(src), open_checkpoint(dst)
        out_chunks = ChunkSource(out)
        try:
            targets = {f: identity_target(source_view(e)) for f, e in out.tensors.items()}
            checked = check_decoded_source(ckpt, targets, dcp_read_back(out, out_chunks), dst)
        finally:
            out_chunks.close()
        assert checked == sum(1 for e in ckpt.tensors.values() for c in e.chunks if c.numel)
        for entry in ckpt.tensors.values():
            assert decode_source_item(ckpt, entry, entry.chunks[0]).shape == entry.chunks[0].sizes
        assert snapshot(src) == before
