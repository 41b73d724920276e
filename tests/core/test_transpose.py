"""Transposed pieces: a block of a source placed with its dims reordered, from chunks cut on any dim.

The sources are saved by DCP itself from DTensors on a 2 × 2 gloo mesh, sharded on two dims at
once (unevenly), so a transposed block meets chunks cut across both its rows and its columns.
Every assembled box is compared with torch's own `permute` of the whole tensor, bit for bit,
including the same box streamed block by block through the engine.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ckptctl.core.dtypes import as_dtype
from ckptctl.engine import cpu
from ckptctl.engine.cpu import ChunkSource, OutputFiles, assemble_bytes, stream_item
from ckptctl.formats.dcp.metadata import open_checkpoint
from ckptctl.core.geometry import Box
from ckptctl.core.plan import Piece, StreamItem, TargetTensor, TransposedRead, missing_elements, plan_box, source_view
from fixtures.gloo import run_ranks

SHAPES = {"a": ((6, 10, 14), torch.float32, (0, 1)), "b": ((7, 9, 5), torch.bfloat16, (2, 1)),
          "c": ((5, 12, 3), torch.float32, (1, 2))}
"""Name → (shape, dtype, the dims the 2 × 2 mesh shards it on)."""


def full(name: str) -> torch.Tensor:
    shape, dtype, _ = SHAPES[name]
    return (torch.arange(math.prod(shape), dtype=torch.float64) * 0.37 - 11).reshape(shape).to(dtype)


def _save(rank: int, world: int, out: str) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (2, 2))
    state = {name: distribute_tensor(full(name), mesh, [Shard(d) for d in dims])
             for name, (_, _, dims) in SHAPES.items()}
    dcp.save(state, checkpoint_id=out)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    out = tmp_path_factory.mktemp("transpose") / "ckpt"
    run_ranks(_save, 4, str(out))
    ckpt = open_checkpoint(out)
    sources = ChunkSource(ckpt)
    yield ckpt, sources
    sources.close()


def test_chunks_are_cut_on_two_dims(saved):
    ckpt, _ = saved
    cut = {name: {d for c in e.chunks for d, s in enumerate(c.sizes) if s != e.shape[d]}
           for name, e in ckpt.tensors.items()}
    assert cut == {"a": {0, 1}, "b": {1, 2}, "c": {1, 2}}


@st.composite
def transposed_pieces(draw):
    """A source, a block of it, and where its dims go: every dim kept (a permutation), or one unit dim dropped."""
    name = draw(st.sampled_from(sorted(SHAPES)))
    shape = SHAPES[name][0]
    starts = [draw(st.integers(0, n - 1)) for n in shape]
    sizes = [draw(st.integers(1, n - s)) for n, s in zip(shape, starts)]
    order = draw(st.permutations(range(3)))
    axes: list[int | None] = list(order)
    if draw(st.booleans()):  # drop a source dim (one expert of a stack) or add a unit dim
        k = draw(st.integers(0, 2))
        sizes[order[k]] = 1
        axes[k] = None if draw(st.booleans()) else order[k]
        if axes[k] is not None:
            axes.pop(k)
    dst_sizes = tuple(1 if a is None else sizes[a] for a in axes)
    dst_start = tuple(draw(st.integers(0, 2)) for _ in dst_sizes)
    dtype = draw(st.sampled_from([None, torch.bfloat16, torch.float32]))
    add = draw(st.sampled_from([0.0, 1.0]))
    return name, tuple(starts), tuple(sizes), tuple(axes), dst_start, dst_sizes, dtype, add


def expected(name, starts, sizes, axes, dst_sizes, dtype, add) -> torch.Tensor:
    block = full(name)[tuple(slice(s, s + n) for s, n in zip(starts, sizes))]
    kept = [a for a in axes if a is not None]
    moved = block.permute(*kept, *(a for a in range(3) if a not in kept)).reshape(dst_sizes)
    out = dtype or block.dtype
    wide = moved.dtype if moved.dtype.itemsize >= out.itemsize else out
    return (moved.to(wide) + add).to(out) if add else moved.to(out)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=transposed_pieces(), corner=st.booleans())
def test_a_transposed_block_is_torchs_permute(saved, case, corner):
    ckpt, sources = saved
    name, starts, sizes, axes, dst_start, dst_sizes, dtype, add = case
    src = source_view(ckpt.tensors[name])
    shape = tuple(d + n + 1 for d, n in zip(dst_start, dst_sizes))
    target = TargetTensor("t", shape, dtype or src.dtype, (Piece(name, starts, dst_start, dst_sizes, axes),), add=add)
    box = Box(dst_start, dst_sizes)
    if corner:  # a box of the target that cuts the piece (and takes some of what no piece fills)
        box = Box(tuple(d + n // 2 for d, n in zip(dst_start, dst_sizes)), tuple(n - n // 2 + 1 for n in dst_sizes))
    reads = plan_box(target, box, {name: src})
    assert reads and all(isinstance(r, TransposedRead) for r in reads)
    got = torch.frombuffer(assemble_bytes(StreamItem("", 0, b"", target, box, reads), sources),
                           dtype=target.dtype.torch).reshape(box.sizes)
    want = torch.zeros(shape, dtype=target.dtype.torch)
    want[tuple(slice(d, d + n) for d, n in zip(dst_start, dst_sizes))] = expected(
        name, starts, sizes, axes, dst_sizes, dtype, add)
    want = want[tuple(slice(o, o + n) for o, n in zip(box.offsets, box.sizes))]
    assert torch.equal(got.view(torch.uint8), want.contiguous().view(torch.uint8))
    inside = Box(dst_start, dst_sizes).intersect(box)
    assert missing_elements(box, reads) == box.numel - inside.numel


def test_a_record_streamed_in_small_blocks_and_tiles_is_the_same(saved, tmp_path, monkeypatch):
    """Blocks that end mid-row and tiles halved to fit their span give the bytes of one assembly."""
    ckpt, sources = saved
    src = source_view(ckpt.tensors["a"])
    target = TargetTensor("t", (14, 10, 6), src.dtype, (Piece("a", (0, 0, 0), (0, 0, 0), (14, 10, 6), (2, 1, 0)),))
    box = Box((0, 0, 0), target.shape)
    item = StreamItem("out", 0, b"", target, box, plan_box(target, box, {"a": src}))
    monkeypatch.setattr(cpu, "TRANSPOSE_BLOCK_BYTES", 4 * 37)
    monkeypatch.setattr(cpu, "TILE_SPAN_BYTES", 4 * 20)
    files = OutputFiles(tmp_path, {"out": target.nbytes}, sync=False)
    stream_item(item, sources, files, lambda n: None)
    files.close()
    got = torch.frombuffer(bytearray((tmp_path / "out").read_bytes()), dtype=torch.float32).reshape(target.shape)
    assert torch.equal(got, full("a").permute(2, 1, 0))


@pytest.mark.parametrize("stored,box", [((840,), Box((97,), (611,))), ((140, 6), Box((23, 2), (100, 3)))])
def test_a_target_stored_in_another_shape_takes_transposed_pieces(saved, tmp_path, monkeypatch, stored, box):
    """Pieces in the logical shape [14, 10, 6], the target stored flat or as [140, 6]: any box of
    the stored tensor, assembled whole or streamed in blocks that end mid-frame, is the permute's."""
    ckpt, sources = saved
    src = source_view(ckpt.tensors["a"])
    target = TargetTensor("t", stored, src.dtype, (Piece("a", (0, 0, 0), (0, 0, 0), (14, 10, 6), (2, 1, 0)),),
                          logical_shape=(14, 10, 6))
    reads = plan_box(target, box, {"a": src})
    assert {type(r) for r in reads} == {TransposedRead} and missing_elements(box, reads) == 0
    want = full("a").permute(2, 1, 0).reshape(stored)[tuple(slice(o, o + n) for o, n in zip(box.offsets, box.sizes))]
    item = StreamItem("out", 0, b"", target, box, reads)
    got = torch.frombuffer(assemble_bytes(item, sources), dtype=torch.float32).reshape(box.sizes)
    assert torch.equal(got, want)
    monkeypatch.setattr(cpu, "TRANSPOSE_BLOCK_BYTES", 4 * 29)
    files = OutputFiles(tmp_path, {"out": box.numel * 4}, sync=False)
    stream_item(item, sources, files, lambda n: None)
    files.close()
    streamed = torch.frombuffer(bytearray((tmp_path / "out").read_bytes()), dtype=torch.float32)
    assert torch.equal(streamed.reshape(box.sizes), want)


def test_dtype_of_the_read_is_the_sources(saved):
    ckpt, _ = saved
    src = source_view(ckpt.tensors["b"])
    target = dataclasses.replace(TargetTensor("t", (5, 9), src.dtype, (Piece("b", (3, 0, 0), (0, 0), (5, 9), (2, 1)),)),
                                 dtype=torch.float32)
    reads = plan_box(target, Box((0, 0), (5, 9)), {"b": src})
    assert {r.dtype for r in reads} == {as_dtype(torch.bfloat16)}
    assert sum(r.numel for r in reads) == 45 and sum(r.run_count for r in reads) == 9 * 1 * 2
