"""Structured fuzzer: opcode-level mutations of the real fixtures' pickles and item zips.

Each example copies a committed fixture and mutates its `.metadata` pickle at the opcode level
(swapped globals, wrong types, huge lengths, deep nesting, BUILD after any value, dict
keys CPython's tuple hashing cannot survive, millions of values padding the stack, a
BYTEARRAY8 of a terabyte), one item's zip headers, or one pickled value where the checkpoint
keeps it (`common.pt`, Megatron-FSDP's `args` entry, a DCP bytes entry: the value's own
`data.pkl`, mutated the same way, with hash bombs in dict keys and frozensets among the
edits). `.metadata` and item examples run through `open_checkpoint`, the analysis, locating
every chunk and a small reshard; value examples through every decoder of pickled values
(`training_args`, `common_state`, `checkpoint_args`, `decode_value`, each bytes entry) and
writing the decoded values back. A fourth campaign mutates a small Hugging Face folder (its
`config.json`, `model.safetensors.index.json` and safetensors headers, at the JSON level and the
byte level: huge and negative counts, deep nesting, `auto_map`, paths out of the folder, dims
and offsets past the data) and runs it through `load_hf_config`, the folder reader and a real
`import-hf`. Only ckptctl's own errors (and a value's documented refusal, UnsafePickleError)
may escape, each example stays within a time bound, and a canary global that would create a
file is never called.

`python -m tests.fuzz_inputs [EXAMPLES]` runs a campaign in a fresh process (what
`make fuzz` calls with many examples, and tests/test_fuzz_inputs.py with a few): after a
warm-up on the unmutated fixtures its peak RSS is the baseline, and no example may raise
the process's peak by more than `MAX_EXTRA_RSS_MB`.
"""

from __future__ import annotations

import contextlib
import io
import math
import pickle
import pickletools
import resource
import shutil
import struct
import sys
import tempfile
import time
import zipfile
from pathlib import Path
from typing import Callable, Iterator

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ckptctl.util.errors import CkptctlError
from ckptctl.formats.dcp.items import ItemReader
from ckptctl.formats.dcp.metadata import open_checkpoint
from ckptctl.formats.safetensors.reader import open_safetensors_folder
from ckptctl.formats.megatron_args import checkpoint_args, common_state, decoded_item, training_args
from ckptctl.formats.torch_save.writer import decode_value, encode_value
from ckptctl.formats.pickle.unpickle import UnsafePickleError
from ckptctl.families.base import load_hf_config
from ckptctl.commands.import_hf import ImportOptions, import_hf
from ckptctl.core.analysis import analysis
from ckptctl.commands.reshard import ReshardOptions, reshard

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
    b"\x96" + struct.pack("<Q", 1 << 40),  # BYTEARRAY8 of a terabyte: C allocates it before reading
    b"]" * 150_000, b"h\x00" * 150_000, b"N" * 150_000,  # more values on the stack than any real pickle holds
]
_SHARED = b")q\x000" + b"".join(b"h%ch%c\x86q%c0" % (i, i, i + 1) for i in range(60))
_HASH_BOMBS = [  # dict keys and set members CPython cannot hash: 2^61 tuples through the memo; 200,000 nested
    b"}" + _SHARED + b"h<K\x01s0",
    b"})" + b"\x85" * 200_000 + b"K\x01s0",
    _SHARED + b"(h<\x910",  # FROZENSET: C hashes its members
    b"\x8f(" + _SHARED + b"h<\x900",  # EMPTY_SET, ADDITEMS
    b"}" + _SHARED + b"c__builtin__\nfrozenset\n]h<a\x85RK\x01s0",  # a frozenset key, as protocol 2 writes one
    b"}" + b")q\x000" + b"".join(b"h%ch%c\x86q%c0" % (i, i, i + 1) for i in range(13)) + b"h\x0dK\x01s0",
    b"]" * 100_000 + b"a" * 99_999 + b"0",  # a value nested 100,000 lists deep
]
_CANARY_CALL = b"cposix\nsystem\nX" + struct.pack("<I", len(f"touch {CANARY}")) + f"touch {CANARY}".encode() + b"\x85R"
_VALUE_GLOBALS = [
    b"c__builtin__\nfrozenset\n", b"c__builtin__\nset\n", b"ccollections\nOrderedDict\n", b"cargparse\nNamespace\n",
    b"c_codecs\nencode\n", b"c__builtin__\nbytearray\n", b"ctorch._utils\n_rebuild_tensor_v2\n",
    b"cenum\nEnum\n", b"c__builtin__\ngetattr\n",
]
VALUE_PLACES = (("megatron_torch_dist", "common.pt"), ("megatron_fs_model_space", "common.pt"),
                ("megatron_tp2_dp2", "args"), ("flat_optim", "iteration"))
"""Where the fixtures keep pickled values: a file beside the DCP ones, or a DCP bytes entry."""
_LENGTH = 0x5A5A5A5A
"""The placeholder length a bytes entry's template `.metadata` gives it (`_templates`)."""


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
def value_mutation(draw: st.DrawFn, data: bytes) -> bytes:
    """A pickled value's `data.pkl` with one to three opcode-level edits (hash bombs and other values'
    globals among them)."""
    positions = _ops(data)
    out = data
    for _ in range(draw(st.integers(1, 3))):
        at = min(draw(st.sampled_from(positions)), len(out) - 1)
        kind = draw(st.sampled_from(["insert", "replace", "truncate", "byte", "canary", "hash", "build"]))
        if kind in ("insert", "replace"):
            piece = draw(st.sampled_from(_VALUES + _GLOBALS + _VALUE_GLOBALS))
            out = out[:at] + piece + out[at + (kind == "replace"):]
        elif kind == "truncate":
            out = out[:at]
        elif kind == "byte":
            out = out[:at] + bytes([draw(st.integers(0, 255))]) + out[at + 1:]
        elif kind == "hash":
            out = out[:at] + draw(st.sampled_from(_HASH_BOMBS)) + out[at:]
        elif kind == "build":
            out = out[:at] + b"}X\x08\x00\x00\x00itemsizeK\x01sb" + out[at:]
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


def exercise_values(src: Path, work: Path) -> None:
    """Every decoder of a pickled value, and writing the decoded values back: only CkptctlError, or a
    value's refusal (UnsafePickleError), may come out."""
    for decode in (training_args, common_state, checkpoint_args):
        try:
            ckpt = open_checkpoint(src)
            found = decode(ckpt)
            state = getattr(found, "state", None)
            if state is not None:
                encode_value(state)
        except (CkptctlError, UnsafePickleError):
            pass
    try:
        ckpt = open_checkpoint(src)
        with ItemReader(ckpt) as reader:
            for fqn, entry in ckpt.bytes_entries.items():
                for decode in (lambda: decode_value(reader.read_item_bytes(entry.file, entry.offset, entry.length,
                                                                           entry.transforms)),
                               lambda: decoded_item(ckpt, fqn, reader)):
                    try:
                        encode_value(decode())
                    except UnsafePickleError:
                        pass
    except CkptctlError:
        pass


@contextlib.contextmanager
def _bounded(what: str) -> Iterator[None]:
    """One example: within MAX_EXAMPLE_SECONDS, the canary untouched (`what` ran no code), and the
    process's peak RSS within MAX_EXTRA_RSS_MB of the baseline once there is one."""
    started = time.monotonic()
    yield
    assert time.monotonic() - started < MAX_EXAMPLE_SECONDS
    assert not CANARY.exists(), f"{what} ran code"
    if _baseline_rss_mb:
        grew = peak_rss_mb() - _baseline_rss_mb[0]
        assert grew <= MAX_EXTRA_RSS_MB, f"peak RSS grew by {grew:.0f} MB"


def _one(name: str, file: str | None = None, data: bytes = b"") -> None:
    """Fixture `name` with `file` replaced by `data` (none replaced without a file) through `exercise`."""
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        src = work / "src"
        shutil.copytree(FIXTURES / name, src)
        if file is not None:
            (src / file).write_bytes(data)
        with _bounded("a pickle"):
            exercise(src, work)


def _value_one(place: tuple[str, str], pickled: bytes) -> None:
    """The fixture of `place` with its pickled value's `data.pkl` made `pickled`, through `exercise_values`."""
    name, where = place
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        src = work / "src"
        shutil.copytree(FIXTURES / name, src)
        archive = _archive(_originals()[place][0], pickled)
        if where == "common.pt":
            (src / where).write_bytes(archive)
        else:
            template, file = _templates()[place]
            with open(src / file, "ab") as f:
                f.write(archive)
            (src / ".metadata").write_bytes(template.replace(b"J" + struct.pack("<i", _LENGTH),
                                                             b"J" + struct.pack("<i", len(archive))))
        with _bounded("a pickle"):
            exercise_values(src, work)


def _archive(original: bytes, pickled: bytes) -> bytes:
    """`original` (a torch.save archive) with its `data.pkl` made `pickled`."""
    buf = io.BytesIO()
    with zipfile.ZipFile(io.BytesIO(original)) as old, zipfile.ZipFile(buf, "w", zipfile.ZIP_STORED) as new:
        for info in old.infolist():
            new.writestr(info.filename, pickled if info.filename.endswith("/data.pkl") else old.read(info))
    return buf.getvalue()


_CACHE: dict[str, dict] = {}


def _originals() -> dict[tuple[str, str], tuple[bytes, bytes]]:
    """Each place's torch.save archive as the fixture holds it, and its data.pkl."""
    if "originals" not in _CACHE:
        out = {}
        for place in VALUE_PLACES:
            name, where = place
            if where == "common.pt":
                archive = (FIXTURES / name / where).read_bytes()
            else:
                ckpt = open_checkpoint(FIXTURES / name)
                entry = ckpt.bytes_entries[where]
                with ItemReader(ckpt) as reader:
                    archive = reader.read_item_bytes(entry.file, entry.offset, entry.length, entry.transforms)
            with zipfile.ZipFile(io.BytesIO(archive)) as z:
                out[place] = archive, z.read(next(n for n in z.namelist() if n.endswith("/data.pkl")))
        _CACHE["originals"] = out
    return _CACHE["originals"]


def _templates() -> dict[tuple[str, str], tuple[bytes, str]]:
    """For each bytes-entry place: the fixture's `.metadata` with the entry moved to the end of its file
    (pickled by torch's own classes, the test side's trusted reader), its length `_LENGTH`."""
    if "templates" not in _CACHE:
        from torch.distributed.checkpoint.metadata import MetadataIndex

        out = {}
        for place in VALUE_PLACES:
            name, where = place
            if where == "common.pt":
                continue
            md = pickle.loads((FIXTURES / name / ".metadata").read_bytes())
            info = md.storage_data[MetadataIndex(where)]
            info.offset, info.length = (FIXTURES / name / info.relative_path).stat().st_size, _LENGTH
            data = pickle.dumps(md, protocol=2)
            assert data.count(b"J" + struct.pack("<i", _LENGTH)) == 1
            out[place] = data, info.relative_path
        _CACHE["templates"] = out
    return _CACHE["templates"]


HF_CONFIG = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 8, "hidden_size": 4,
             "intermediate_size": 8, "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1,
             "head_dim": 2, "tie_word_embeddings": False, "rms_norm_eps": 1e-6}
HF_TENSORS = {"model.embed_tokens.weight": [8, 4], "model.norm.weight": [4], "lm_head.weight": [8, 4],
              "model.layers.0.input_layernorm.weight": [4], "model.layers.0.post_attention_layernorm.weight": [4],
              "model.layers.0.self_attn.q_proj.weight": [4, 4], "model.layers.0.self_attn.k_proj.weight": [2, 4],
              "model.layers.0.self_attn.v_proj.weight": [2, 4], "model.layers.0.self_attn.o_proj.weight": [4, 4],
              "model.layers.0.mlp.gate_proj.weight": [8, 4], "model.layers.0.mlp.up_proj.weight": [8, 4],
              "model.layers.0.mlp.down_proj.weight": [4, 8]}
"""A tiny Llama as a Hugging Face folder holds it (two shards and their index), written here by hand."""
HF_FILES = ("config.json", "model.safetensors.index.json", "model-00001-of-00002.safetensors",
            "model-00002-of-00002.safetensors")
_JSON_VALUES = [10**12, 20000, -1, 0, 2**63, 1.5, "x", "../../etc/passwd", "/etc/passwd", "", None, True, [], {},
                [[[[[[[[1]]]]]]]], {"AutoModel": "evil.Model"}, "model-00009-of-00002.safetensors", "."]


def _safetensors(tensors: dict[str, list[int]]) -> bytes:
    """A safetensors file of float32 tensors: its header, then the elements (i / 8 each)."""
    import json

    header, at = {}, 0
    for name, shape in tensors.items():
        n = 4 * math.prod(shape)
        header[name] = {"dtype": "F32", "shape": shape, "data_offsets": [at, at + n]}
        at += n
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    data = b"".join(struct.pack("<f", i / 8) for i in range(at // 4))
    return struct.pack("<Q", len(text)) + text + data


def hf_folder() -> dict[str, bytes]:
    """The tiny Llama's files, by name."""
    import json

    names = list(HF_TENSORS)
    shards = {HF_FILES[2]: names[:6], HF_FILES[3]: names[6:]}
    files = {HF_FILES[0]: json.dumps(HF_CONFIG).encode()}
    files[HF_FILES[1]] = json.dumps({"metadata": {"total_size": 4 * sum(math.prod(s) for s in HF_TENSORS.values())},
                                     "weight_map": {n: f for f, ns in shards.items() for n in ns}}).encode()
    for file, ns in shards.items():
        files[file] = _safetensors({n: HF_TENSORS[n] for n in ns})
    return files


@st.composite
def hf_mutation(draw: st.DrawFn, files: dict[str, bytes]) -> tuple[str, bytes]:
    """One file of the folder with one to three edits: a JSON value replaced (config keys, the index's
    file names, a safetensors header's dims, offsets and dtype), or its bytes cut, flipped or padded."""
    import json

    name = draw(st.sampled_from(HF_FILES))
    data = files[name]
    for _ in range(draw(st.integers(1, 3))):
        kind = draw(st.sampled_from(["json", "json", "truncate", "byte", "length", "nest"]))
        head = 8 if name.endswith(".safetensors") else 0
        size = struct.unpack("<Q", data[:8])[0] if head and len(data) >= 8 else len(data)
        if kind in ("json", "nest"):
            try:
                doc = json.loads(data[head:head + size])
            except (ValueError, RecursionError):  # an earlier edit broke or nested it
                continue
            if not isinstance(doc, dict) or not doc:
                continue
            key = draw(st.sampled_from(sorted(doc)))
            target, field = doc, key
            if isinstance(doc[key], dict) and doc[key]:  # an index's weight_map, a header's tensor record
                target, field = doc[key], draw(st.sampled_from(sorted(doc[key])))
            value = "[" * 100_000 if kind == "nest" else draw(st.sampled_from(_JSON_VALUES))
            if draw(st.booleans()):
                target[field] = value
            else:
                doc[draw(st.sampled_from(["auto_map", "n_layer", "num_experts", "layer_types", field + "_"]))] = value
            text = json.dumps(doc).encode().replace(b'"' + b"[" * 100_000 + b'"', b"[" * 100_000)
            data = struct.pack("<Q", len(text)) + text + data[head + size:] if head else text
        elif kind == "truncate":
            data = data[:draw(st.integers(0, max(0, len(data) - 1)))]
        elif kind == "byte" and data:
            at = draw(st.integers(0, len(data) - 1))
            data = data[:at] + bytes([draw(st.integers(0, 255))]) + data[at + 1:]
        elif kind == "length" and head:
            data = struct.pack("<Q", draw(st.sampled_from([0, 1, 7, 1 << 20, 1 << 40, (1 << 64) - 1]))) + data[8:]
    return name, data


def exercise_hf(src: Path, work: Path) -> None:
    """What a command does with a Hugging Face folder: its config, the folder as a checkpoint, and a
    real import (names checked by the rules, not transformers): only CkptctlError may come out."""
    for step in (lambda: load_hf_config(src),
                 lambda: analysis(open_safetensors_folder(src)),
                 lambda: import_hf(src, work / "dst", ImportOptions(world_size=2, workers=1, device="cpu",
                                                                    sync=False, name_check=False), force=True)):
        try:
            step()
        except CkptctlError:
            pass


def _hf_one(files: dict[str, bytes], name: str | None = None, data: bytes = b"") -> None:
    """The tiny Llama folder with file `name` made `data` (none changed without a name), through `exercise_hf`."""
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        src = work / "src"
        src.mkdir()
        for file, content in files.items():
            (src / file).write_bytes(data if file == name else content)
        with _bounded("a model folder"):
            exercise_hf(src, work)


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


def fuzz_values(examples: int) -> None:
    """Mutated pickled values in every place the fixtures keep one."""
    originals = _originals()

    @settings(max_examples=examples, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    @given(st.sampled_from(VALUE_PLACES).flatmap(
        lambda p: st.tuples(st.just(p), value_mutation(originals[p][1]))))
    def run(case: tuple[tuple[str, str], bytes]) -> None:
        _value_one(*case)

    run()


def fuzz_hf(examples: int) -> None:
    """Mutated files of a small Hugging Face folder."""
    files = hf_folder()

    @settings(max_examples=examples, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    @given(hf_mutation(files))
    def run(case: tuple[str, bytes]) -> None:
        _hf_one(files, *case)

    run()


def main(argv: list[str]) -> None:
    examples = int(argv[0]) if argv else 2000
    CANARY.unlink(missing_ok=True)
    started = time.monotonic()
    for name in NAMES:  # imports, caches and allocator pools settle before the baseline
        _one(name)
    for place, (_, pickled) in _originals().items():
        _value_one(place, pickled)
    _hf_one(hf_folder())
    _baseline_rss_mb.append(peak_rss_mb())
    fuzz_metadata(examples)
    fuzz_items(examples)
    fuzz_values(examples)
    fuzz_hf(examples)
    print(f"fuzz: {4 * examples} examples (.metadata, item zips, pickled values, HF folders), only ckptctl errors, "
          f"canary untouched, peak RSS {peak_rss_mb():.0f} MB (baseline {_baseline_rss_mb[0]:.0f} MB), "
          f"{time.monotonic() - started:.0f} s")


if __name__ == "__main__":
    main(sys.argv[1:])
