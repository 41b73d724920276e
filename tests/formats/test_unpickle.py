"""The restricted unpicklers load real DCP pickles and refuse everything that could run code."""

from __future__ import annotations

import io
import os
import pickle
import warnings
import zipfile
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import metadata as torch_md

from ckptctl.util.errors import CheckpointError
from ckptctl.formats.dcp import classes
from ckptctl.formats.pickle import torch_pickle
from ckptctl.formats.dcp.items import ItemReader
from ckptctl.formats.pickle.unpickle import (
    UnsafePickleError,
    load_metadata_pickle,
    load_tensor_record_spec,
)
from ckptctl.core.checkpoint import BytesEntry, Checkpoint, Chunk, TensorEntry


class RunsShell:
    """Unpickling this calls `os.system(command)` (pickled as the global `posix.system`)."""

    def __init__(self, command: str) -> None:
        self.command = command

    def __reduce__(self) -> tuple:
        return os.system, (self.command,)


def hostile(marker: Path) -> bytes:
    return pickle.dumps(RunsShell(f"touch {marker}"), protocol=2)


@pytest.fixture(scope="session")
def real_metadata(tmp_path_factory) -> bytes:
    path = tmp_path_factory.mktemp("real") / "ckpt"
    sd = {"w": torch.arange(6, dtype=torch.bfloat16).reshape(2, 3), "step": torch.tensor(1.0), "epoch": 3}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(sd, checkpoint_id=path, no_dist=True)
    return (path / ".metadata").read_bytes()


def described(md) -> dict:
    """A metadata object (torch's classes or ckptctl's stand-ins) as plain values."""
    def props(p):
        fmt = p.memory_format  # DCP's enum value in a stand-in, a torch.memory_format in torch's class
        fmt = ("torch.contiguous_format", "torch.channels_last", "torch.preserve_format")[fmt] \
            if isinstance(fmt, int) else str(fmt)
        return str(p.dtype), str(p.layout), p.requires_grad, fmt, p.pin_memory

    entries = {}
    for fqn, item in md.state_dict_metadata.items():
        if type(item).__name__ == "TensorStorageMetadata":
            entries[fqn] = (props(item.properties), tuple(item.size),
                            [(tuple(c.offsets), tuple(c.sizes)) for c in item.chunks])
        else:
            entries[fqn] = type(item).__name__
    storage = {(i.fqn, None if i.offset is None else tuple(i.offset), i.index):
               (s.relative_path, s.offset, s.length, s.transform_descriptors) for i, s in md.storage_data.items()}
    meta = md.storage_meta
    return {"entries": entries, "storage": storage, "planner": md.planner_data, "version": md.version,
            "meta": (meta.checkpoint_id, meta.save_id, meta.load_id, meta.modules)}


def test_real_metadata_loads_as_torch_would(real_metadata: bytes) -> None:
    ours = load_metadata_pickle(real_metadata)
    theirs = pickle.loads(real_metadata)
    assert isinstance(ours, classes.Metadata)
    assert described(ours) == described(theirs)
    w = ours.state_dict_metadata["w"]
    assert isinstance(w, classes.TensorStorageMetadata) and w.properties.dtype == torch.bfloat16
    assert list(w.size) == [2, 3]


def test_stand_ins_pickle_back_as_torchs_own_classes(real_metadata: bytes) -> None:
    """Written without importing DCP, read back by plain pickle into DCP's classes, equal to the original."""
    again = pickle.loads(torch_pickle.dumps(load_metadata_pickle(real_metadata)))
    theirs = pickle.loads(real_metadata)
    assert type(again) is torch_md.Metadata
    assert again.state_dict_metadata == theirs.state_dict_metadata
    assert again.storage_data == theirs.storage_data
    assert described(again) == described(theirs)
    assert type(again.state_dict_metadata["w"].properties.memory_format) is torch.memory_format


def test_hostile_global_is_refused_and_never_called(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    with pytest.raises(UnsafePickleError, match=r"^refuses to load global posix\.system$"):
        load_metadata_pickle(hostile(marker))
    assert not marker.exists()


def test_hostile_object_nested_inside_real_metadata_is_refused(real_metadata: bytes, tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    md = pickle.loads(real_metadata)
    md.planner_data = {"w": RunsShell(f"touch {marker}")}
    with pytest.raises(UnsafePickleError, match="posix.system"):
        load_metadata_pickle(pickle.dumps(md))
    assert not marker.exists()


@pytest.mark.parametrize("module, name", [
    ("builtins", "eval"), ("builtins", "getattr"), ("torch", "load"), ("subprocess", "Popen"),
    ("torch.distributed.checkpoint.metadata", "os"),
])
def test_globals_outside_the_allow_list_are_refused(module: str, name: str) -> None:
    data = b"\x80\x02c" + f"{module}\n{name}\n".encode() + b"."
    with pytest.raises(UnsafePickleError, match=f"refuses to load global {module}.{name}"):
        load_metadata_pickle(data)


def test_persistent_references_are_refused_in_metadata() -> None:
    with pytest.raises(UnsafePickleError, match="refuses persistent references"):
        load_metadata_pickle(b"\x80\x02X\x01\x00\x00\x00aQ.")


def test_unknown_layout_name_is_refused() -> None:
    data = b"\x80\x02ctorch.serialization\n_get_layout\nX\x0b\x00\x00\x00torch.bogus\x85R."
    with pytest.raises(UnsafePickleError, match="unknown tensor layout 'torch.bogus'"):
        load_metadata_pickle(data)


def _data_pkl(tensor: torch.Tensor) -> bytes:
    buf = io.BytesIO()
    torch.save(tensor, buf)
    with zipfile.ZipFile(io.BytesIO(buf.getvalue())) as archive:
        return archive.read(next(n for n in archive.namelist() if n.endswith("data.pkl")))


def test_tensor_record_spec_describes_views_without_building_them() -> None:
    base = torch.arange(24, dtype=torch.float16).reshape(4, 6)
    spec = load_tensor_record_spec(_data_pkl(base[1:3]))
    assert (spec.dtype, spec.storage_numel, spec.storage_offset, spec.size, spec.stride, spec.is_dense) == (
        torch.float16, 24, 6, (2, 6), (6, 1), True)
    spec = load_tensor_record_spec(_data_pkl(base.t()))
    assert (spec.size, spec.stride, spec.is_dense) == ((6, 4), (1, 6), False)
    assert load_tensor_record_spec(_data_pkl(torch.tensor(5, dtype=torch.int64))).size == ()


def test_hostile_data_pkl_is_refused(tmp_path: Path) -> None:
    with pytest.raises(UnsafePickleError, match="posix.system"):
        load_tensor_record_spec(hostile(tmp_path / "pwned"))
    with pytest.raises(UnsafePickleError, match="item is not a single tensor"):
        load_tensor_record_spec(pickle.dumps({"a": 1}, protocol=2))
    assert not (tmp_path / "pwned").exists()


def _archive(data_pkl: bytes, payload: bytes = b"\0" * 16) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_STORED) as archive:
        archive.writestr("archive/data.pkl", data_pkl)
        archive.writestr("archive/data/0", payload)
    return buf.getvalue()


def _one_item_checkpoint(root: Path, item: bytes) -> Checkpoint:
    root.mkdir()
    (root / "__0_0.distcp").write_bytes(item)
    chunk = Chunk("__0_0.distcp", 0, len(item), (0,), (4,))
    return Checkpoint(
        path=root,
        tensors={"x": TensorEntry("x", (4,), torch.float32, (chunk,))},
        bytes_entries={"obj": BytesEntry("obj", "__0_0.distcp", 0, len(item))},
        files={"__0_0.distcp": len(item)},
    )


def test_item_reader_refuses_a_hostile_tensor_item_without_running_it(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    ckpt = _one_item_checkpoint(tmp_path / "ckpt", _archive(hostile(marker)))
    with ItemReader(ckpt) as reader, pytest.raises(CheckpointError) as err:
        reader.read_chunk(ckpt.tensors["x"], ckpt.tensors["x"].chunks[0])
    assert str(err.value) == (f"{ckpt.path}/__0_0.distcp: item at byte 0: hostile or foreign data.pkl: "
                              "refuses to load global posix.system")
    assert not marker.exists()


def test_item_reader_refuses_a_hostile_bytes_item_without_running_it(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    ckpt = _one_item_checkpoint(tmp_path / "ckpt", _archive(hostile(marker)))
    with ItemReader(ckpt) as reader, pytest.raises(CheckpointError, match="obj: cannot decode bytes entry"):
        reader.load_bytes_value(ckpt.bytes_entries["obj"])
    assert not marker.exists()


def test_item_whose_data_pkl_disagrees_with_metadata_is_refused(tmp_path: Path) -> None:
    ckpt = _one_item_checkpoint(tmp_path / "ckpt", _archive(_data_pkl(torch.zeros(2, 2, dtype=torch.float32))))
    with ItemReader(ckpt) as reader, pytest.raises(CheckpointError) as err:
        reader.read_chunk(ckpt.tensors["x"], ckpt.tensors["x"].chunks[0])
    assert str(err.value).endswith("item at byte 0: x: item holds float32 [2, 2], metadata says float32 [4]")


# -- C's unpickler only ever sees inert stand-ins: BUILD, NEWOBJ and REDUCE cannot reach a real object --

from ckptctl.core import dtypes as _dtypes  # noqa: E402
from ckptctl.formats.pickle import unpickle as _unpickle  # noqa: E402
from ckptctl.formats.pickle.vm import Constructor, MalformedPickleError  # noqa: E402


def _shared_state() -> tuple:
    """What a BUILD that reached a real object would change: dtypes, the stand-in classes, path classes."""
    import pathlib

    stand_ins = (*{c for c in classes.METADATA_CLASSES.values()}, pathlib.PurePosixPath, pathlib.PosixPath,
                 _unpickle.TensorRecordSpec)
    return (tuple((d.name, d.itemsize, d.kind) for d in _dtypes.DTYPES.values()),
            tuple((c, dict(vars(c))) for c in stand_ins))


def _global(module: str, name: str) -> bytes:
    return b"c" + f"{module}\n{name}\n".encode()


def _label(value) -> str:
    return value.name if type(value) is Constructor else f"a {type(value).__name__}"


_STATES = {"dict": b"}X\x08\x00\x00\x00itemsizeK\x01s",
           "slots": b"N}X\t\x00\x00\x00__class__K\x01s\x86"}
_ALL_GLOBALS = sorted({**_unpickle.METADATA_GLOBALS, **_unpickle.TENSOR_RECORD_GLOBALS}.items())


@pytest.mark.parametrize("state", sorted(_STATES))
@pytest.mark.parametrize("key, value", _ALL_GLOBALS, ids=[".".join(k) for k, _ in _ALL_GLOBALS])
def test_build_on_any_allowed_global_even_from_the_memo_is_refused(key, value, state: str, tmp_path: Path) -> None:
    before = _shared_state()
    load = load_metadata_pickle if key in _unpickle.METADATA_GLOBALS else load_tensor_record_spec
    for data in (_global(*key) + _STATES[state] + b"b.",  # on the global itself
                 _global(*key) + b"q\x000h\x00" + _STATES[state] + b"b."):  # on the global fetched from the memo
        with pytest.raises(UnsafePickleError) as err:
            load(b"\x80\x02" + data)
        assert str(err.value) == f"refuses to set the state of {_label(value)} (only of a new object)"
    assert _shared_state() == before


def test_slot_state_build_on_a_record_shell_never_sets_attributes() -> None:
    before = _shared_state()
    chunk = _global(classes.DCP_METADATA, "ChunkStorageMetadata") + b")\x81"
    with pytest.raises(MalformedPickleError) as err:
        load_metadata_pickle(b"\x80\x02" + _global(classes.DCP_METADATA, "Metadata") + b")\x81}"
                             b"X\x13\x00\x00\x00state_dict_metadata}X\x01\x00\x00\x00w" +
                             _global(classes.DCP_METADATA, "TensorStorageMetadata") + b")\x81}"
                             b"X\x06\x00\x00\x00chunks]" + chunk + _STATES["slots"] + b"basbssb.")
    assert str(err.value).startswith("TensorStorageMetadata.properties should be a TensorProperties")
    assert _shared_state() == before


@pytest.mark.parametrize("key, label", [(("pathlib", "PosixPath"), "pathlib.PosixPath"),
                                        (("torch", "Size"), "torch.Size"), (("torch", "float32"), "a DType")])
def test_newobj_of_anything_but_a_record_is_refused(key, label: str) -> None:
    with pytest.raises(MalformedPickleError, match=rf"^pickle creates an instance of {label}, which is not allowed$"):
        load_metadata_pickle(b"\x80\x02" + _global(*key) + b")\x81.")


def test_a_record_class_cannot_be_called() -> None:
    with pytest.raises(MalformedPickleError, match=r"^pickle calls torch\.distributed\.checkpoint\.metadata\."
                                                   r"ChunkStorageMetadata, which cannot be called$"):
        load_metadata_pickle(b"\x80\x02" + _global(classes.DCP_METADATA, "ChunkStorageMetadata") + b")R.")


def test_build_on_a_constructed_path_is_refused() -> None:
    with pytest.raises(UnsafePickleError, match=r"^refuses to set the state of a PurePosixPath \(only of a new object\)$"):
        load_metadata_pickle(b"\x80\x02" + _global("pathlib", "PurePosixPath") + b"X\x01\x00\x00\x00a\x85R" +
                             b"N}X\x05\x00\x00\x00_rootX\x01\x00\x00\x00/s\x86b.")


def test_build_on_a_tensor_spec_is_refused() -> None:
    pkl = _data_pkl(torch.zeros(4))
    assert pkl.endswith(b".")
    with pytest.raises(UnsafePickleError, match=r"^refuses to set the state of a TensorRecordSpec"):
        load_tensor_record_spec(pkl[:-1] + b"}X\x0e\x00\x00\x00storage_offsetJ\xfc\xff\xff\xffsb.")


@pytest.mark.parametrize("opcode, width, what", [(b"\x8d", 8, "string"), (b"\x8e", 8, "bytes value"),
                                                 (b"X", 4, "string")])
def test_a_declared_length_beyond_the_data_is_never_allocated(opcode: bytes, width: int, what: str) -> None:
    import tracemalloc

    n = (1 << 40) if width == 8 else (1 << 31)
    tracemalloc.start()
    try:
        with pytest.raises(MalformedPickleError, match=rf"^{what} of {n} bytes is over the 1048576-byte limit$"):
            load_metadata_pickle(b"\x80\x02" + opcode + n.to_bytes(width, "little") + b"x" * 100 + b".")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 16 << 20, peak


def test_memo_references_to_one_chunk_are_charged(real_metadata: bytes) -> None:
    md = pickle.loads(real_metadata)
    w = md.state_dict_metadata["w"]
    w.chunks = w.chunks[:1] * 200_000
    with pytest.raises(MalformedPickleError, match=r"memo amplification"):
        load_metadata_pickle(pickle.dumps(md, protocol=4))
