"""Hostile pickled values, in every place a checkpoint holds one, end in one line and bounded memory.

Each value is real pickle bytes: a dict key CPython's tuple hashing cannot survive (2^61 tuples
shared through the memo, or 8,191 of them, or 300,000 nested), the same inside a frozenset, a
list nested 100,000 deep, and a stack padded with empty lists. Each is put, as a `torch.save`
archive, where a checkpoint keeps pickled values (`common.pt`, the torch_dist `common_state`
item, the Megatron-FSDP `args` entry, a DCP bytes entry) of a copy of a committed fixture, and
the real CLI commands that decode it are run: exit 2, the exact line, the child's peak RSS and
wall time bounded. `.metadata` padded with 20M empty lists or memo references, and the 16-byte
BYTEARRAY8 one, are refused the same way.
"""

from __future__ import annotations

import io
import pickle
import pickletools
import struct
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from ckptctl.formats.dcp.metadata import open_checkpoint
from ckptctl.formats.pickle.hash_guard import MAX_KEY_NODES, probe_allowance
from ckptctl.formats.pickle.vm import MAX_STACK
from ckptctl.formats.pickle.unpickle import MAX_DEPTH
from tests.conftest import ROOT
from tests.test_hostile_input import MAX_RSS_MB, MAX_SECONDS, copy_fixture, real_metadata, run_measured, snapshot


def shared_levels(depth: int) -> bytes:
    """Memo entry `depth` + 1 is t_depth, where t_0 = () and t_(i+1) = (t_i, t_i): 2^(depth+1) - 1 tuples."""
    return b")q\x000" + b"".join(b"h%ch%c\x86q%c0" % (i, i, i + 1) for i in range(depth))


def keyed_by(key: bytes) -> bytes:
    """A protocol-2 pickle of a dict whose one key is what `key` (pickle bytes, one value) builds."""
    return b"\x80\x02}" + key + b"K\x01s."


MEMO = "pickle builds more values than its size allows (memo amplification?)"
TUPLES = ": tuples nested or shared so that hashing a dict key would crash or hang"
VALUES = {
    "hash-bomb": (keyed_by(shared_levels(60) + b"h<"), MEMO),
    "frozenset-bomb": (keyed_by(shared_levels(60) + b"c__builtin__\nfrozenset\n]h<a\x85R"), MEMO),
    "shared-tuples-key": (keyed_by(shared_levels(12) + b"h\x0c"),
                          f"a dict key or set member made of more than {MAX_KEY_NODES} tuples" + TUPLES),
    "shared-tuples-frozenset": (keyed_by(shared_levels(12) + b"c__builtin__\nfrozenset\n]h\x0ca\x85R"),
                                f"a dict key or set member made of more than {MAX_KEY_NODES} tuples" + TUPLES),
    "nested-tuples-key": (keyed_by(b")" + b"\x85" * 300_000),
                          f"a dict key or set member made of more than {MAX_KEY_NODES} tuples" + TUPLES),
    "nested-lists": (b"\x80\x02" + b"]" * 100_000 + b"a" * 99_999 + b".",
                     f"value nested more than {MAX_DEPTH} containers deep"),
    "stack-padding": (b"\x80\x02" + b"]" * 2_000_000 + b"}.",
                      f"pickle holds more than {MAX_STACK} values on its stack at once"),
}


def torch_save_archive(pickled: bytes) -> bytes:
    """`pickled` as a torch.save archive's data.pkl (stored, as torch writes it)."""
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_STORED) as archive:
        archive.writestr("archive/data.pkl", pickled)
        archive.writestr("archive/version", b"3\n")
    return buf.getvalue()


def replace_bytes_entry(src: Path, fqn: str, value: bytes, new: bool = False) -> tuple[Path, int]:
    """Bytes entry `fqn` of checkpoint `src` (added when `new`) made `value`, appended to its item
    file; `.metadata` rewritten to point at it. Returns (the item file, the entry's offset)."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex

    md = real_metadata(src)
    if new:
        md.state_dict_metadata[fqn] = BytesStorageMetadata()
        md.storage_data[MetadataIndex(fqn)] = _StorageInfo("__0_0.distcp", 0, 0)
    info = md.storage_data[MetadataIndex(fqn)]
    file = src / info.relative_path
    info.offset, info.length = file.stat().st_size, len(value)
    with open(file, "ab") as f:
        f.write(value)
    (src / ".metadata").write_bytes(pickle.dumps(md))
    return file, info.offset


def assert_refused(tmp_path: Path, src: Path, args: list, line: str, max_rss_mb: float = MAX_RSS_MB) -> None:
    before = snapshot(src)
    proc, rss, seconds = run_measured(tmp_path, *args)
    assert (proc.returncode, proc.stderr, proc.stdout) == (2, f"ckptctl: error: {line}\n", "")
    assert rss <= max_rss_mb and seconds <= MAX_SECONDS, (rss, seconds)
    assert snapshot(src) == before


@pytest.mark.parametrize("case", sorted(VALUES))
def test_hostile_common_pt(case: str, tmp_path: Path) -> None:
    """megatron-core ≤ 0.18's common state: inspect shows its args; reshard rewrites it (fully_sharded_model_space)."""
    pickled, reason = VALUES[case]
    src = copy_fixture(tmp_path, "megatron_fs_model_space")
    (src / "common.pt").write_bytes(torch_save_archive(pickled))
    line = f"{src / 'common.pt'}: corrupt pickle: {reason}"
    assert_refused(tmp_path, src, ["inspect", src], line)
    assert_refused(tmp_path, src, ["reshard", src, tmp_path / "dst"], line)
    assert not (tmp_path / "dst").exists()


@pytest.mark.parametrize("case", ["hash-bomb", "frozenset-bomb", "nested-tuples-key"])
def test_hostile_common_state_item(case: str, tmp_path: Path) -> None:
    """megatron-core ≥ 0.19 keeps the common state in the bytes item `common_state/shard_0_1`."""
    pickled, reason = VALUES[case]
    src = copy_fixture(tmp_path, "megatron_torch_dist")
    (src / "common.pt").unlink()
    file, offset = replace_bytes_entry(src, "common_state/shard_0_1", torch_save_archive(pickled), new=True)
    assert_refused(tmp_path, src, ["inspect", src],
                   f"{file}: bytes entry common_state/shard_0_1 at byte {offset}: corrupt pickle: {reason}")


@pytest.mark.parametrize("case", sorted(VALUES))
def test_hostile_megatron_fsdp_args(case: str, tmp_path: Path) -> None:
    """Megatron-FSDP's `args` entry: inspect shows it, a reshard to another TP takes the TP size from it
    (export-hf does too, through the same `checkpoint_args`, for fused TP-blocked tensors)."""
    pickled, reason = VALUES[case]
    src = copy_fixture(tmp_path, "megatron_tp2_dp2")
    file, offset = replace_bytes_entry(src, "args", torch_save_archive(pickled))
    line = f"{file}: bytes entry args at byte {offset}: corrupt pickle: {reason}"
    assert_refused(tmp_path, src, ["inspect", src], line)
    assert_refused(tmp_path, src, ["reshard", src, tmp_path / "dst", "--tp", "1", "--world-size", "2"], line)
    assert not (tmp_path / "dst").exists()


@pytest.mark.parametrize("case", sorted(VALUES))
def test_hostile_bytes_entry_in_export_torch(case: str, tmp_path: Path) -> None:
    pickled, reason = VALUES[case]
    src = copy_fixture(tmp_path, "flat_optim")
    replace_bytes_entry(src, "iteration", torch_save_archive(pickled))
    entry = open_checkpoint(src).bytes_entries["iteration"]
    assert_refused(tmp_path, src, ["export-torch", src, tmp_path / "o.pt"],
                   f"{src / entry.file}: bytes entry iteration at byte {entry.offset}: corrupt pickle: {reason}")
    assert not (tmp_path / "o.pt").exists()


def padded_metadata(src: Path, padding: bytes, after: str | None) -> int:
    """The fixture's `.metadata` with `padding` inserted after its first `after` opcode (after PROTO
    when None): values left on the stack below the Metadata, which C's unpickler returns all the same."""
    real = (src / ".metadata").read_bytes()
    at = 2 if after is None else next(pos for op, _, pos in pickletools.genops(real) if op.name == after) + 1
    data = real[:at] + padding + real[at:]
    (src / ".metadata").write_bytes(data)
    return len(data)


@pytest.mark.parametrize("padding, after", [(b"]" * 20_000_000, None), (b"h\x00" * 20_000_000, "MEMOIZE")],
                         ids=["20M-empty-lists", "20M-memo-references"])
def test_metadata_padded_with_millions_of_values_is_refused_in_bounded_memory(padding: bytes, after: str | None,
                                                                               tmp_path: Path) -> None:
    src = copy_fixture(tmp_path)
    size = padded_metadata(src, padding, after)
    bound = (probe_allowance(size) >> 20) + 128  # the probe child's allowance over a process of about 100 MB
    assert_refused(tmp_path, src, ["inspect", src], f"{src / '.metadata'}: corrupt metadata pickle: pickle holds "
                   f"more than {MAX_STACK} values on its stack at once", max_rss_mb=bound)


def test_bytearray8_of_a_terabyte_is_one_line_every_time(tmp_path: Path) -> None:
    """C's unpickler allocates a BYTEARRAY8's bytes before reading them; a failed allocation frees a
    half-made bytearray whose export count was never set, and CPython prints a stray SystemError
    line when it happens to be non-zero. The probe meets the allocation first and the pickle never
    reaches the real load."""
    src = copy_fixture(tmp_path)
    (src / ".metadata").write_bytes(b"\x80\x05\x96" + struct.pack("<Q", 1 << 40) + b"abcde")
    line = f"ckptctl: error: {src / '.metadata'}: hostile or foreign pickle: refuses pickle opcode b'\\x96'\n"
    for _ in range(30):
        proc = subprocess.run([sys.executable, "-m", "ckptctl", "inspect", str(src)], capture_output=True, text=True,
                              timeout=60, cwd=ROOT)
        assert (proc.returncode, proc.stderr) == (2, line)


@pytest.mark.parametrize("protocol", [2, 3, 4, 5])
def test_plain_values_decode_as_pickled_by_every_protocol(protocol: int) -> None:
    """The bounded decoder reads what pickle writes: sets and frozensets (REDUCE, or protocol 4's own
    opcodes), strings and bytes past the `.metadata` name limit, a lone surrogate, a big integer."""
    from argparse import Namespace

    from ckptctl.formats.pickle.unpickle import load_value_pickle

    value = {"blob": b"x" * 3_000_000, "text": "s" * 2_000_000 + "\ud800", "sets": [{1, 2}, frozenset({(3, 4)})],
             "big": 2 ** 100, (1, ("a", 2.5)): None, "args": Namespace(lr=0.1, layers=[1, 2])}
    assert load_value_pickle(pickle.dumps(value, protocol=protocol)) == value


def test_output_check_refuses_an_ordered_dict_filled_by_its_arguments() -> None:
    """The output check reads source records with Python's unpickler: OrderedDict(pairs) would hash a
    key of 2^61 shared tuples in C, uninterruptibly. Run in a child, so that a regression is a timeout."""
    pickled = (b"\x80\x02ccollections\nOrderedDict\n)q\x00" + b"".join(b"h%c\x86q%c" % (i, i + 1) for i in range(60))
               + b"K\x01\x86\x85\x85R.")
    code = ("import sys, pickle; from ckptctl.checks.output_check import tensor_view\n"
            "try:\n    tensor_view(sys.stdin.buffer.read())\nexcept pickle.UnpicklingError as exc:\n    print(exc)")
    proc = subprocess.run([sys.executable, "-c", code], input=pickled, capture_output=True, timeout=60, cwd=ROOT)
    assert (proc.returncode, proc.stdout, proc.stderr) == (0, b"OrderedDict built with arguments\n", b"")
