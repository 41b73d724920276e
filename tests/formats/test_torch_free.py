"""Reading, planning and copying never import torch: its start-up outweighs a gigabyte of copying.

torch is imported only to compute (casts, adds, decoding zstd items, verification), so a
plain reshard, export or inspect runs without it. ckptctl's dtype table and its metadata
stand-ins must agree with torch's own, which these tests check against torch itself.
"""

from __future__ import annotations

import json
import pickle
import pickletools
import random
import subprocess
import sys

import pytest
import torch

from tests.conftest import ROOT
from ckptctl.core.dtypes import DTYPES, as_dtype
from ckptctl.formats.pickle import torch_pickle
from ckptctl.formats.dcp.classes import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageInfo,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
    size,
)
from ckptctl.formats.pickle.torch_pickle import Size

RUN_AND_LIST_TORCH = """
import json, runpy, sys
sys.argv = ["ckptctl", *json.loads(sys.argv[1])]
try:
    runpy.run_module("ckptctl", run_name="__main__")
except SystemExit as exc:
    code = exc.code
print(json.dumps({"code": code, "torch": sorted(m for m in sys.modules if m == "torch" or m.startswith("torch."))}))
"""


def modules_after(*args: str) -> dict:
    proc = subprocess.run([sys.executable, "-c", RUN_AND_LIST_TORCH, json.dumps([str(a) for a in args])],
                          capture_output=True, text=True, cwd=ROOT, timeout=300)
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def hf_config(tmp_path_factory):
    path = tmp_path_factory.mktemp("hfcfg")
    (path / "config.json").write_text('{"model_type": "raw"}')
    return path


@pytest.mark.parametrize("command", ["inspect", "reshard", "export-hf"])
def test_plain_commands_never_import_torch(command, fixture_ckpt, tmp_path, hf_config):
    src = fixture_ckpt("fsdp2_4ranks")
    args = {"inspect": ["inspect", src, "--check", "--json"],
            "reshard": ["reshard", src, tmp_path / "out", "-n", "3", "--device", "auto"],
            "export-hf": ["export-hf", src, tmp_path / "hf", "--hf-config", hf_config, "--arch", "raw",
                                  "--no-name-check"]}[command]
    assert modules_after(*args) == {"code": 0, "torch": []}


def test_a_cast_does_import_torch(fixture_ckpt, tmp_path):
    """The check above can fail: computing needs torch, and then it is there."""
    got = modules_after("reshard", fixture_ckpt("fsdp2_4ranks"), tmp_path / "out", "-n", "3", "--dtype", "bf16")
    assert got["code"] == 0 and "torch" in got["torch"]


def test_dtype_table_matches_torch():
    storage_names = {str(d).removeprefix("torch."): t for d, t in torch.storage._dtype_to_storage_type_map().items()}
    for name, d in DTYPES.items():
        t = getattr(torch, name)
        assert (d.itemsize, d.is_floating_point, d.is_complex) == (t.itemsize, t.is_floating_point, t.is_complex), name
        assert d.storage == storage_names.get(name), name
        assert d == t and t == d and d.torch is t and as_dtype(t) is d and str(d) == str(t)
    assert DTYPES["float32"] != torch.bfloat16 and DTYPES["float32"] != DTYPES["bfloat16"]


def test_sizes_and_dtypes_pickle_as_torchs_own():
    value = [size((3, 4)), DTYPES["bfloat16"], ChunkStorageMetadata(size((0, 2)), size((3, 2)))]
    again = pickle.loads(torch_pickle.dumps(value))
    assert type(again[0]) is torch.Size and again[0] == torch.Size([3, 4])
    assert again[1] is torch.bfloat16
    assert type(again[2]).__module__ == "torch.distributed.checkpoint.metadata"
    assert (again[2].offsets, again[2].sizes) == (torch.Size([0, 2]), torch.Size([3, 2]))


RESHARDS = {
    "fsdp2_4ranks-n3": ("fsdp2_4ranks", {"world_size": 3}),
    "fsdp2_4ranks-n5-bf16": ("fsdp2_4ranks", {"world_size": 5, "dtype": as_dtype("bfloat16")}),
    "fsdp2_4ranks-model-only": ("fsdp2_4ranks", {"world_size": 2, "include": ["model.*"]}),
    "flat_optim-n2": ("flat_optim", {"world_size": 2}),
    "broken_plain_optim-n3": ("broken_plain_optim", {"world_size": 3, "allow_incomplete": True}),
    "zstd-n3": ("zstd", {"world_size": 3}),
    "megatron-split": ("megatron_tp2_dp2", {"world_size": 2, "split_fused": True}),
    "megatron-fuse": ("megatron_tp2_dp2", {"world_size": 2, "fuse": True, "tp": 2}),
    "megatron-fsdp-flat": ("megatron_tp2_dp2", {"world_size": 4, "layout": "megatron-fsdp", "tp": 2, "dp": 2,
                                                "flat_optimizer": True}),
}


def no_fallback(monkeypatch) -> None:
    """From now on, fail if `metadata_out` hands the metadata to `torch_pickle` instead of writing it itself."""
    from ckptctl.formats.dcp import metadata_out

    def refuse(*_):
        raise AssertionError("fell back to torch_pickle")

    monkeypatch.setattr(metadata_out.torch_pickle, "dumps", refuse)


@pytest.mark.parametrize("case", RESHARDS)
def test_metadata_is_torch_pickles_bytes_for_every_fixture_reshard(case, fixture_ckpt, monkeypatch):
    """`metadata_pickle` writes exactly what the pure-Python pickler writes, and torch reads it as `md`."""
    from ckptctl.formats.dcp import metadata_out, writer
    from ckptctl.formats.dcp.metadata import open_checkpoint
    from ckptctl.formats.pickle.unpickle import load_metadata_pickle
    from ckptctl.commands.reshard import ReshardOptions, plan_reshard

    name, options = RESHARDS[case]
    streamed = writer.build_metadata(plan_reshard(open_checkpoint(fixture_ckpt(name)), ReshardOptions(**options)))
    md = metadata_out.materialized(streamed)
    expected = torch_pickle.dumps(md)
    no_fallback(monkeypatch)
    data = writer.metadata_pickle(streamed)
    assert data == expected
    theirs = pickle.loads(data)
    assert type(theirs).__module__ == "torch.distributed.checkpoint.metadata"
    assert load_metadata_pickle(pickle.dumps(theirs)) == md


def synthetic_metadata(seed: int, tensors: int, chunks: int) -> Metadata:
    """Metadata of every shape `build_metadata` makes, and some: bytes entries with and without
    transforms, 0-d and 4-d tensors, huge offsets, shared and non-ASCII strings, long names,
    planner_data paths as tuples (some the same object), lists and ints."""
    rng = random.Random(seed)
    files = [f"__{r}_0.distcp" for r in range(4)]
    dims = [0, 1, 2, 2, 4]

    def number() -> int:
        return rng.choice([0, 1, 255, 256, 65535, 65536, 2**31, 2**63 + 1, rng.randrange(100_000)])

    sd: dict = {}
    storage: dict = {}
    for b in range(rng.randrange(1, 300)):
        fqn = f"extra.{b}." + rng.choice(["é" * 150, "x" * 300, "step"])
        sd[fqn] = BytesStorageMetadata()
        storage[MetadataIndex(fqn)] = StorageInfo(files[0], number(), number(), rng.choice([None, ["stream.zstd/1"]]))
    for t in range(tensors):
        fqn = f"model.layers.{t}.weight"
        ndim = rng.choice(dims)
        tensor_chunks = []
        for i in range(rng.randrange(chunks + 1)):
            offsets = size(number() for _ in range(ndim))
            tensor_chunks.append(ChunkStorageMetadata(offsets, size(number() for _ in range(ndim))))
            file = rng.choice(files) if rng.random() < 0.5 else f"__{i % 4}_0.distcp"  # shared or fresh objects
            storage[MetadataIndex(fqn, offsets, i)] = StorageInfo(file, number(), number())
        properties = TensorProperties(rng.choice(list(DTYPES.values())), requires_grad=rng.random() < 0.3)
        sd[fqn] = TensorStorageMetadata(properties, size(number() for _ in range(ndim)), tensor_chunks)
    shared_path = ("model", "x" * 70_000)  # a str longer than a frame goes outside the frames
    planner = {fqn: rng.choice([tuple(fqn.split(".")), shared_path, [*fqn.split("."), 3], ()]) for fqn in sd}
    return Metadata(state_dict_metadata=sd, planner_data=planner, storage_data=storage,
                    storage_meta=StorageMeta(checkpoint_id=None, save_id=None, modules=[]), version="1.0.0")


@pytest.mark.parametrize("seed, tensors, chunks", [(0, 3, 2500), (1, 1200, 3), (2, 40, 60)])
def test_metadata_of_many_frames_memo_entries_and_batches_is_torch_pickles_bytes(seed, tensors, chunks, monkeypatch):
    """Frames (64 KiB) end at every byte of a chunk's template somewhere; memo indexes past 255
    take LONG_BINGET; lists and dicts over 1,000 items take several APPENDS/SETITEMS."""
    from ckptctl.formats.dcp import writer

    md = synthetic_metadata(seed, tensors, chunks)
    expected = torch_pickle.dumps(md)
    opcodes = [op.name for op, _, _ in pickletools.genops(expected)]
    assert {"LONG_BINGET", "BINGET", "APPENDS", "SETITEMS", "BINUNICODE", "TUPLE", "LONG1"} <= set(opcodes)
    assert opcodes.count("FRAME") >= 3
    no_fallback(monkeypatch)
    assert writer.metadata_pickle(md) == expected


def test_values_outside_metadatas_shape_still_get_torch_pickles_bytes():
    """A float in planner_data or a record's subclass goes to torch_pickle; a bool in a Size, a
    field set again (out of order) or a chunk with a dict key not interned is written one save at a time."""
    from ckptctl.formats.dcp import writer

    md = synthetic_metadata(3, 4, 5)
    md.planner_data["model.layers.0.weight"] = ("model", 1.5)
    assert writer.metadata_pickle(md) == torch_pickle.dumps(md)

    class Chunk(ChunkStorageMetadata):
        pass

    md = synthetic_metadata(4, 4, 5)
    odd = [Chunk(size((1,)), size((2,))), ChunkStorageMetadata(Size((True,)), size((2,))),
           ChunkStorageMetadata(size((1,)), size((2,))), ChunkStorageMetadata(size((3,)), size((4,)))]
    del odd[2].offsets
    odd[2].offsets = size((5,))
    odd[3].__dict__.clear()
    odd[3].__dict__.update({"".join(["off", "sets"]): size((3,)), "sizes": size((4,))})
    md.state_dict_metadata["model.layers.0.weight"].chunks.extend(odd)
    assert writer.metadata_pickle(md) == torch_pickle.dumps(md)


BIG_METADATA_WITHOUT_TORCH = """
import json, sys
from ckptctl.formats.dcp import writer
from ckptctl.formats.dcp.classes import *
from ckptctl.core.dtypes import DTYPES
storage, sd = {}, {}
for t in range(100):
    fqn = f"layers.{t}.weight"
    chunks = [ChunkStorageMetadata(size((4 * r, 0)), size((4, 16))) for r in range(300)]
    for r, c in enumerate(chunks):
        storage[MetadataIndex(fqn, c.offsets, r)] = StorageInfo(f"__{r}_0.distcp", 1000 * t, 1000)
    sd[fqn] = TensorStorageMetadata(TensorProperties(DTYPES["float32"]), size((1200, 16)), chunks)
md = Metadata(state_dict_metadata=sd, planner_data={k: tuple(k.split(".")) for k in sd}, storage_data=storage,
              storage_meta=StorageMeta(modules=[]), version="1.0.0")
data = writer.metadata_pickle(md)
print(json.dumps({"entries": len(storage), "torch": sorted(m for m in sys.modules if m.split(".")[0] == "torch")}))
"""


def test_big_metadata_is_written_without_importing_torch():
    """30,000 storage entries (above the 25,000 where torch's C pickler used to take over)."""
    proc = subprocess.run([sys.executable, "-c", BIG_METADATA_WITHOUT_TORCH], capture_output=True, text=True, cwd=ROOT,
                          timeout=300)
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == {"entries": 30_000, "torch": []}, proc.stderr


def test_streamed_metadata_outside_the_templates_shape_is_torch_pickles_bytes(fixture_ckpt):
    """A value the direct writer does not write (a float in planner_data) sends the whole metadata
    through `torch_pickle`, its streamed chunk lists and storage dict made real first."""
    from ckptctl.formats.dcp import metadata_out, writer
    from ckptctl.formats.dcp.metadata import open_checkpoint
    from ckptctl.commands.reshard import ReshardOptions, plan_reshard

    streamed = writer.build_metadata(plan_reshard(open_checkpoint(fixture_ckpt("fsdp2_4ranks")),
                                                      ReshardOptions(world_size=3)))
    streamed.planner_data = {"model.embed.weight": ("model", 0.5)}
    assert type(streamed.storage_data) is metadata_out.StreamedDict
    assert writer.metadata_pickle(streamed) == torch_pickle.dumps(metadata_out.materialized(streamed))
    theirs = pickle.loads(writer.metadata_pickle(streamed))
    assert len(theirs.storage_data) == len(dict(streamed.storage_data.items())) == len(streamed.storage_data) == 87
