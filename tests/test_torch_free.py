"""Reading, planning and copying never import torch: its start-up outweighs a gigabyte of copying.

torch is imported only to compute (casts, adds, decoding zstd items, verification), so a
plain reshard, export or inspect runs without it. ckptctl's dtype table and its metadata
stand-ins must agree with torch's own, which these tests check against torch itself.
"""

from __future__ import annotations

import json
import pickle
import subprocess
import sys

import pytest
import torch

from tests.conftest import ROOT
from ckptctl.dtypes import DTYPES, as_dtype
from ckptctl.formats import torch_pickle
from ckptctl.formats.dcp_classes import ChunkStorageMetadata, size

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


def test_big_metadata_is_pickled_through_torchs_classes_with_the_same_content(fixture_ckpt, monkeypatch):
    """Above TORCH_PICKLER_ENTRIES the C pickler writes torch's own objects: same content as the Python writer."""
    from ckptctl.formats import dcp_writer
    from ckptctl.formats.dcp_classes import to_torch
    from ckptctl.formats.dcp_metadata import open_checkpoint
    from ckptctl.reshard import ReshardOptions, plan_reshard

    md = dcp_writer.build_metadata(plan_reshard(open_checkpoint(fixture_ckpt("fsdp2_4ranks")),
                                                ReshardOptions(world_size=3)))
    ours, theirs = pickle.loads(torch_pickle.dumps(md)), pickle.loads(pickle.dumps(to_torch(md)))
    for field in ("state_dict_metadata", "storage_data", "planner_data", "storage_meta", "version"):
        assert getattr(ours, field) == getattr(theirs, field), field
    assert len(md.storage_data) < dcp_writer.TORCH_PICKLER_ENTRIES
    monkeypatch.setattr(dcp_writer, "TORCH_PICKLER_ENTRIES", 0)
    assert dcp_writer.metadata_pickle(md) == pickle.dumps(to_torch(md))
