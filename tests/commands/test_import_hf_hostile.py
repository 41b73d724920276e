"""import-hf on damaged or hostile safetensors folders: a ckptctl error or a verified output, nothing else.

A real `save_pretrained` folder (three shards and an index) is mutated — header bytes,
header JSON values, the index's file names, the data's length — and imported with
`--verify` in-process. Every run must either write an output that verifies or stop with a
CkptctlError (one line at the CLI); any other exception is a defect. Names are not checked
against transformers here (the mutations are what is under test, not the model).
"""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ckptctl.util.errors import CkptctlError
from ckptctl.commands.import_hf import ImportOptions, import_hf
from tests.conftest import tiny_llama_folder

pytest.importorskip("transformers")  # the folders are written by its save_pretrained


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return tiny_llama_folder(tmp_path_factory.mktemp("hostile") / "hf", 1, max_shard_size="2KB")


def _import(src: Path, dst: Path) -> None:
    opts = ImportOptions(world_size=2, name_check=False, workers=1, sync=False)
    try:
        import_hf(src, dst, opts, force=True, verify=True)
    except CkptctlError:
        return
    assert (dst / ".metadata").is_file()


def _shards(folder: Path) -> list[Path]:
    return sorted(folder.glob("*.safetensors"))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_flipped_header_bytes_end_in_a_ckptctl_error_or_a_verified_output(folder, tmp_path_factory, data):
    work = tmp_path_factory.mktemp("flip")
    src = work / "hf"
    shutil.copytree(folder, src)
    shard = data.draw(st.sampled_from(_shards(src)))
    raw = bytearray(shard.read_bytes())
    (n,) = struct.unpack("<Q", raw[:8])
    for _ in range(data.draw(st.integers(1, 4))):
        at = data.draw(st.integers(0, 8 + n - 1))
        raw[at] = data.draw(st.integers(0, 255))
    shard.write_bytes(bytes(raw[:data.draw(st.integers(8, len(raw)))]) if data.draw(st.booleans()) else bytes(raw))
    _import(src, work / "out")


JSON_VALUES = st.recursive(st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats() | st.text(max_size=8),
                           lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner,
                                                                                        max_size=3), max_leaves=8)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_rewritten_header_and_index_values_end_in_a_ckptctl_error_or_a_verified_output(folder, tmp_path_factory,
                                                                                      data):
    work = tmp_path_factory.mktemp("json")
    src = work / "hf"
    shutil.copytree(folder, src)
    if data.draw(st.booleans()):
        index = src / "model.safetensors.index.json"
        doc = json.loads(index.read_text())
        name = data.draw(st.sampled_from(sorted(doc["weight_map"])))
        doc["weight_map"][name] = data.draw(JSON_VALUES | st.sampled_from(["../x.safetensors", "/etc/passwd",
                                                                           "missing.safetensors"]))
        index.write_text(json.dumps(doc))
    else:
        shard = data.draw(st.sampled_from(_shards(src)))
        raw = shard.read_bytes()
        (n,) = struct.unpack("<Q", raw[:8])
        header = json.loads(raw[8:8 + n])
        name = data.draw(st.sampled_from(sorted(k for k in header if k != "__metadata__")))
        field = data.draw(st.sampled_from(["dtype", "shape", "data_offsets"]))
        header[name][field] = data.draw(JSON_VALUES)
        text = json.dumps(header).encode()
        shard.write_bytes(struct.pack("<Q", len(text)) + text + raw[8 + n:])
    _import(src, work / "out")
