"""Structured fuzzer: opcode-level mutations of the real fixtures' pickles and item zips.

Each example copies a committed fixture, mutates its `.metadata` pickle at the opcode level
(swapped globals, wrong types, huge lengths, deep nesting, BUILD after any value, dict
keys CPython's tuple hashing cannot survive) or one
item's zip headers, and runs it through `open_checkpoint`, the analysis, locating every
chunk and a small reshard. Only ckptctl's own errors may escape, each example stays within
a time bound, and a canary global that would create a file is never called.

`python -m tests.fuzz_inputs [EXAMPLES]` runs a campaign in a fresh process (what
`make fuzz` calls with many examples, and tests/test_fuzz_inputs.py with a few): after a
warm-up on the unmutated fixtures its peak RSS is the baseline, and no example may raise
the process's peak by more than `MAX_EXTRA_RSS_MB`.
"""

from __future__ import annotations

import pickletools
import resource
import shutil
import struct
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ckptctl.errors import CkptctlError
from ckptctl.formats.dcp_items import ItemReader
from ckptctl.formats.dcp_metadata import open_checkpoint
from ckptctl.layout import analysis
from ckptctl.reshard import ReshardOptions, reshard

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = ROOT / "fixtures" / "data"
NAMES = ("fsdp2_4ranks", "broken_plain_optim", "flat_optim", "megatron_torch_dist")
CANARY = Path(tempfile.gettempdir()) / "ckptctl-fuzz-canary"
MAX_EXAMPLE_SECONDS = 10.0
MAX_EXTRA_RSS_MB = 256
_baseline_rss_mb: list[float] = []
"""The peak RSS after the warm-up (set by `main`): the high-water mark examples are held to."""

_GLOBALS = [
    b"cposix\nsystem\n", b"cbuiltins\nexec\n", b"ctorch\nfloat32\n", b"ctorch\nSize\n",
    b"cpathlib\nPosixPath\n", b"ctorch.distributed.checkpoint.metadata\nBytesStorageMetadata\n",
    b"ctorch.distributed.checkpoint.metadata\nChunkStorageMetadata\n", b"ccollections\nOrderedDict\n",
    b"ctorch.distributed.checkpoint.planner\nSavePlan\n", b"ctorch.distributed.checkpoint.planner\nWriteItemType\n",
]
_VALUES = [
    b"N", b"\x88", b"K\x07", b"J\xff\xff\xff\xff", b"G" + struct.pack(">d", 1.5), b"]", b"}", b")",
    b"X\x03\x00\x00\x00../", b"X\x05\x00\x00\x00a\x00b.c", b"\x8d" + struct.pack("<Q", 1 << 40),
    b"\x8e" + struct.pack("<Q", (1 << 64) - 1), b"]" * 3000 + b"a" * 2999, b"h\x00", b"j\x00\x00\x01\x00",
    b"X\x0e\x00\x00\x00touch " + b"/tmp/c" + b"\x85R",
]
_HASH_BOMBS = [  # dict keys CPython cannot hash: 2^60 tuples through the memo; 200,000 nested tuples
    b"})q\x000" + b"".join(b"h%ch%c\x86q%c0" % (i, i, i + 1) for i in range(60)) + b"h<K\x01s0",
    b"})" + b"\x85" * 200_000 + b"K\x01s0",
]
_CANARY_CALL = b"cposix\nsystem\nX" + struct.pack("<I", len(f"touch {CANARY}")) + f"touch {CANARY}".encode() + b"\x85R"


def _ops(data: bytes) -> list[int]:
    """Byte positions where the pickle's opcodes start."""
    return [pos for _, _, pos in pickletools.genops(data)]


@st.composite
def metadata_mutation(draw: st.DrawFn, data: bytes) -> bytes:
    """The fixture's metadata with one to three opcode-level edits."""
    positions = _ops(data)
    out = data
    for _ in range(draw(st.integers(1, 3))):
        at = draw(st.sampled_from(positions))
        at = min(at, len(out) - 1)
        kind = draw(st.sampled_from(["insert", "build", "replace", "truncate", "byte", "canary", "hash"]))
        if kind == "insert":
            out = out[:at] + draw(st.sampled_from(_VALUES + _GLOBALS)) + out[at:]
        elif kind == "build":  # a state-setting BUILD after whatever value is on the stack
            out = out[:at] + b"}X\x08\x00\x00\x00itemsizeK\x01sb" + out[at:]
        elif kind == "replace":
            out = out[:at] + draw(st.sampled_from(_VALUES + _GLOBALS)) + out[at + 1:]
        elif kind == "truncate":
            out = out[:at]
        elif kind == "hash":  # a dict keyed by a tuple CPython's own hashing cannot survive
            out = out[:at] + draw(st.sampled_from(_HASH_BOMBS)) + out[at:]
        elif kind == "byte":
            out = out[:at] + bytes([draw(st.integers(0, 255))]) + out[at + 1:]
        else:
            out = out[:at] + _CANARY_CALL + out[at:]
    return out


@st.composite
def item_mutation(draw: st.DrawFn, blob: bytes) -> bytes:
    """A `.distcp` file with zip header fields (signatures, methods, flags, sizes, offsets) changed."""
    out = bytearray(blob)
    marks = [i for i in range(len(blob) - 4) if blob[i:i + 2] == b"PK" and blob[i + 2] in (1, 3, 5, 6, 7)]
    for _ in range(draw(st.integers(1, 3))):
        at = draw(st.sampled_from(marks)) + draw(st.integers(0, 46))
        if at + 4 > len(out):
            continue
        value = draw(st.sampled_from([0, 1, 8, 12, 14, 99, 0x809, 0xFFFF, 0x7FFFFFFF, 0xFFFFFFF0, 0xFFFFFFFF]))
        width = draw(st.sampled_from([1, 2, 4]))
        out[at:at + width] = (value & ((1 << (8 * width)) - 1)).to_bytes(width, "little")
    return bytes(out)


def exercise(src: Path, work: Path) -> None:
    """Everything a command does with a source: only CkptctlError may come out."""
    try:
        ckpt = open_checkpoint(src)
        analysis(ckpt)
        with ItemReader(ckpt) as reader:
            for entry in list(ckpt.tensors.values())[:8]:
                for chunk in entry.chunks:
                    reader.locate(entry, chunk)
        reshard(src, work / "dst", ReshardOptions(world_size=2, workers=1, allow_incomplete=True, device="cpu"),
                force=True)
    except CkptctlError:
        pass


def _one(name: str, file: str | None = None, data: bytes = b"") -> None:
    """Fixture `name` with `file` replaced by `data` (none replaced without a file) through `exercise`."""
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        src = work / "src"
        shutil.copytree(FIXTURES / name, src)
        if file is not None:
            (src / file).write_bytes(data)
        started = time.monotonic()
        exercise(src, work)
        assert time.monotonic() - started < MAX_EXAMPLE_SECONDS
    assert not CANARY.exists(), "a pickle ran code"
    if _baseline_rss_mb:
        grew = peak_rss_mb() - _baseline_rss_mb[0]
        assert grew <= MAX_EXTRA_RSS_MB, f"peak RSS grew by {grew:.0f} MB"


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _campaign(examples: int, file: str, mutation: Callable[[bytes], st.SearchStrategy[bytes]]) -> None:
    """`examples` fixtures, each with `file` replaced by a `mutation` of its own bytes."""
    originals = {name: (FIXTURES / name / file).read_bytes() for name in NAMES}

    @settings(max_examples=examples, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    @given(st.sampled_from(NAMES).flatmap(lambda n: st.tuples(st.just(n), mutation(originals[n]))))
    def run(case: tuple[str, bytes]) -> None:
        _one(case[0], file, case[1])

    run()


def fuzz_metadata(examples: int) -> None:
    """Mutated `.metadata` pickles of every fixture."""
    _campaign(examples, ".metadata", metadata_mutation)


def fuzz_items(examples: int) -> None:
    """Mutated item zips of every fixture's first data file."""
    _campaign(examples, "__0_0.distcp", item_mutation)


def main(argv: list[str]) -> None:
    examples = int(argv[0]) if argv else 2000
    CANARY.unlink(missing_ok=True)
    for name in NAMES:  # imports, caches and allocator pools settle before the baseline
        _one(name)
    _baseline_rss_mb.append(peak_rss_mb())
    fuzz_metadata(examples)
    fuzz_items(examples)
    print(f"fuzz: {2 * examples} examples, only ckptctl errors, canary untouched, "
          f"peak RSS {peak_rss_mb():.0f} MB (baseline {_baseline_rss_mb[0]:.0f} MB)")


if __name__ == "__main__":
    main(sys.argv[1:])
