"""ckptctl's outputs against torch itself, over random state dicts saved by torch's own writer.

Hand-picked cases let two bugs through with exit status 0: reshard at 56+ ranks wrote
`.metadata` entries pointing into the wrong rank file, and a `SerializationFormat.SAFETENSORS`
save (every tensor of a file recorded at one storage offset) was read as its first tensor's
bytes. Here hypothesis draws small state dicts (1-3-D tensors, fewer rows than ranks, one row,
zero-size dims, float32 / bfloat16 / int64, 0-d `step`s, plain values DCP stores as bytes
items, model + optimizer nesting), torch saves each at M ranks in each serialization format
(M > 1: DTensor `Shard(0)` over gloo, from a pool of ranks started once per session:
`fixtures.torch_writers`), and ckptctl's output is read back by torch's own readers and
compared bit for bit with what was saved: `dcp.load` and `read_metadata` after reshard and
import-hf (the chunk boxes and rank files FSDP2 saves at N; at N <= 4 also a real N-rank load
into DTensors), `torch.load` after export-torch (and torch's own `dcp_to_torch_save`),
`safetensors` after export-hf --arch raw.

Tensor values are random bytes, NaN payloads and all: any conversion, not only a misplaced
copy, shows. `make test` runs a bounded, derandomized matrix with the known regressions
pinned as explicit examples; `make test-full` a wide one (N up to 1024). Run with
`--hypothesis-show-statistics` to see the distribution of M, N and formats.
"""

from __future__ import annotations

import json
import os
import shutil
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, event, example, given, note, settings
from hypothesis import strategies as st
from hypothesis.control import currently_in_test_context

import ckptctl
from fixtures.torch_writers import FORMATS, NOT_LOADED, SaveError, SaverPool, StateSpec, TensorSpec, ValueSpec, \
    build_state_dict, row_range, same_bits, save_local, unloaded_like
from tests.conftest import run_cli

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

POOL_RANKS = 4
WIDE_NS = (512, 1024)


# ---------------------------------------------------------------------------------------------
# cases


@dataclass(frozen=True)
class Case:
    """One source checkpoint (saved by torch at `ranks` ranks in `fmt`) and the world sizes it is
    resharded to."""

    spec: StateSpec
    ranks: int
    fmt: str
    ns: tuple[int, ...] = (1,)
    files_per_rank: int = 1


def tiny_llama(layers: int = 2, hidden: int = 32, inter: int = 56, vocab: int = 96, kv: int = 16,
               optim: bool = True) -> StateSpec:
    """A tiny llama's `{"model": ..., "optim": ...}` as FSDP2 + AdamW saves it (the demo's shapes:
    [96, 32], [56, 32], [32, 56], [32], ... and 84 tensors with the optimizer state)."""
    shapes = {"model.embed_tokens.weight": (vocab, hidden)}
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes.update({p + "self_attn.q_proj.weight": (hidden, hidden), p + "self_attn.k_proj.weight": (kv, hidden),
                       p + "self_attn.v_proj.weight": (kv, hidden), p + "self_attn.o_proj.weight": (hidden, hidden),
                       p + "mlp.gate_proj.weight": (inter, hidden), p + "mlp.up_proj.weight": (inter, hidden),
                       p + "mlp.down_proj.weight": (hidden, inter), p + "input_layernorm.weight": (hidden,),
                       p + "post_attention_layernorm.weight": (hidden,)})
    shapes.update({"model.norm.weight": (hidden,), "lm_head.weight": (vocab, hidden)})
    entries: list = [TensorSpec(("model", name), shape, "float32") for name, shape in shapes.items()]
    if optim:
        for name, shape in shapes.items():
            entries += [TensorSpec(("optim", "state", name, "exp_avg"), shape, "float32"),
                        TensorSpec(("optim", "state", name, "exp_avg_sq"), shape, "float32"),
                        TensorSpec(("optim", "state", name, "step"), (), "float32")]
        entries += [ValueSpec(("optim", "param_groups", 0, "lr"), 0.001),
                    ValueSpec(("optim", "param_groups", 0, "betas"), (0.9, 0.999)),
                    ValueSpec(("optim", "param_groups", 0, "params"), list(shapes))]
    return StateSpec(tuple(entries), seed=7)


# Several tensors in each file (what SAFETENSORS records at one storage offset), mixed dtypes.
SEVERAL_PER_FILE = StateSpec((
    TensorSpec(("model", "embed.weight"), (96, 32), "float32"),
    TensorSpec(("model", "mlp.up.weight"), (56, 32), "bfloat16"),
    TensorSpec(("model", "norm.weight"), (32,), "float32"),
    TensorSpec(("model", "head.bias"), (3,), "bfloat16"),
    TensorSpec(("optim", "state", "embed.weight", "exp_avg"), (96, 32), "float32"),
    TensorSpec(("optim", "state", "embed.weight", "step"), (), "int64"),
    ValueSpec(("optim", "param_groups", 0, "lr"), 0.01),
    ValueSpec(("step",), 12),
), seed=1)

# The awkward shapes: fewer rows than ranks, one row, zero-size dims, 3-D.
EDGES = StateSpec((
    TensorSpec(("model", "few.weight"), (3, 5), "float32"),
    TensorSpec(("model", "one.weight"), (1, 4), "bfloat16"),
    TensorSpec(("model", "norows.weight"), (0, 4), "float32"),
    TensorSpec(("model", "nocols.weight"), (6, 0), "float32"),
    TensorSpec(("model", "cube.weight"), (5, 2, 3), "bfloat16"),
    TensorSpec(("model", "buffer"), (4, 2), "float32", sharded=False),
    TensorSpec(("optim", "state", "few.weight", "step"), (), "int64"),
    ValueSpec(("extra", "tag"), "run-1"),
), seed=2)

LLAMA = tiny_llama()
LLAMA_MODEL = tiny_llama(optim=False)
MIXED = StateSpec(SEVERAL_PER_FILE.entries + EDGES.entries, seed=3)


def every_source_kind(ns_for=lambda ranks, i: (1,), **more: Any):
    """Explicit examples: MIXED saved at each M in 1..4 in each format (a bounded derandomized run
    draws too few examples to be sure of every pair), resharded to `ns_for(M, format index)`;
    `more`: the test's other arguments."""
    def add(test):
        for ranks in range(1, POOL_RANKS + 1):
            for i, fmt in enumerate(FORMATS):
                test = example(case=Case(MIXED, ranks=ranks, fmt=fmt, ns=ns_for(ranks, i)), **more)(test)
        return test
    return add

_names = st.sampled_from(["weight", "bias", "norm.weight", "proj.weight"])
_rows = st.one_of(st.integers(0, 5), st.integers(6, 70), st.sampled_from([56, 96, 129, 300, 513]))
_cols = st.one_of(st.integers(1, 6), st.just(0), st.sampled_from([16, 32]))
_values = st.one_of(st.integers(-2**40, 2**40), st.floats(allow_nan=False), st.text(max_size=6), st.booleans(),
                    st.none(), st.lists(st.integers(0, 9), max_size=3))


@st.composite
def tensor_specs(draw, path: tuple, dtype=None, max_numel: int = 12_000) -> TensorSpec:
    ndim = draw(st.sampled_from([1, 2, 2, 3]))
    shape = (draw(_rows), *draw(st.lists(_cols, min_size=ndim - 1, max_size=ndim - 1)))
    while shape[0] > 1 and torch.Size(shape).numel() > max_numel:
        shape = (shape[0] // 2, *shape[1:])
    dtype = dtype or draw(st.sampled_from(["float32", "float32", "bfloat16", "int64"]))
    return TensorSpec(path, shape, dtype, sharded=draw(st.sampled_from([True] * 5 + [False])))


@st.composite
def state_specs(draw, wide: bool = False) -> StateSpec:
    # Mostly a few params; sometimes a model's worth with its optimizer state, 40-130 tensors (the
    # .metadata writer's memo bug showed only past ~40 entries at 56+ ranks, and not every time).
    count = draw(st.sampled_from([1, 2, 3, 4] * (2 if wide else 4) + [20, 32, 48]))
    params = [draw(tensor_specs(("model", f"layers.{i}.{draw(_names)}"), max_numel=12_000 if count < 10 else 1_500))
              for i in range(count)]
    entries: list = list(params)
    if count >= 10 or draw(st.booleans()):  # an optimizer's state, keyed by param fqn, as get_state_dict writes it
        for param in params:
            name = param.path[1]
            if param.dtype == "int64" or not draw(st.integers(0, 3)):
                continue  # no state for this param
            state_dtype = draw(st.sampled_from([param.dtype, "float32"]))
            for kind in ("exp_avg", "exp_avg_sq")[:draw(st.integers(1, 2))]:
                entries.append(TensorSpec(("optim", "state", name, kind), param.shape, state_dtype, param.sharded))
            step_dtype = draw(st.sampled_from(["int64", "float32"]))
            entries.append(TensorSpec(("optim", "state", name, "step"), (), step_dtype))
        entries += [ValueSpec(("optim", "param_groups", 0, "lr"), draw(st.floats(0, 1))),
                    ValueSpec(("optim", "param_groups", 0, "params"), [p.path[1] for p in params])]
    for i in range(draw(st.integers(0, 2))):  # plain values beside them (train state, dataloader, ...)
        entries.append(ValueSpec(("extra", f"v{i}"), draw(_values)))
    return StateSpec(tuple(entries), seed=draw(st.integers(0, 2**16)))


def world_sizes(wide: bool) -> st.SearchStrategy[tuple[int, ...]]:
    n = st.one_of(st.integers(1, 300), st.sampled_from(WIDE_NS)) if wide else \
        st.one_of(st.integers(1, 8), st.integers(9, 300), st.just(WIDE_NS[0]))
    return st.lists(n, min_size=1, max_size=3, unique=True).map(tuple)


@st.composite
def cases(draw, wide: bool = False) -> Case:
    return Case(spec=draw(state_specs(wide)), ranks=draw(st.sampled_from(range(1, POOL_RANKS + 1))),
                fmt=draw(st.sampled_from(FORMATS)), ns=draw(world_sizes(wide)),
                files_per_rank=draw(st.sampled_from([1, 1, 1, 2])))


def n_label(n: int) -> str:
    return next(label for top, label in ((1, "1"), (8, "2-8"), (55, "9-55"), (128, "56-128"), (300, "129-300"),
                                         (512, "512"), (1024, "1024")) if n <= top)


def _event(text: str) -> None:
    """hypothesis `event` (counted by --hypothesis-show-statistics); a no-op in the plain tests."""
    if currently_in_test_context():
        event(text)


def _note(text: str) -> None:
    """hypothesis `note` (printed with a falsifying example); a no-op in the plain tests."""
    if currently_in_test_context():
        note(text)


def record(case: Case, world_sizes: bool = True) -> None:
    _event(f"M={case.ranks}")
    _event(f"format={case.fmt}")
    _event(f"files per rank={case.files_per_rank}")
    for n in case.ns if world_sizes else ():
        _event(f"N={n_label(n)}")


# ---------------------------------------------------------------------------------------------
# torch's side: saving a case, reading outputs back


@pytest.fixture(scope="session")
def savers():
    """Gloo ranks that save with torch's DCP writer, started once for the session."""
    with SaverPool(POOL_RANKS) as pool:
        yield pool


@pytest.fixture(scope="session")
def scratch(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("torch-matrix")


class Workdir:
    """A fresh directory per hypothesis example (function-scoped tmp_path is one per test)."""

    def __init__(self, root: Path):
        self.root, self.count = root, 0

    def __enter__(self) -> Path:
        self.count += 1
        self.path = self.root / f"ex{self.count}"
        self.path.mkdir()
        return self.path

    def __exit__(self, *exc: object) -> None:
        shutil.rmtree(self.path, ignore_errors=True)


@pytest.fixture(scope="session")
def workdirs(scratch) -> Workdir:
    return Workdir(scratch)


def save_case(case: Case, path: Path, savers: SaverPool) -> Path:
    """torch's own save of the case's state dict at `case.ranks` ranks."""
    if case.ranks == 1:
        save_local(case.spec, path, case.fmt, case.files_per_rank)
    else:
        savers.save(case.spec, path, ranks=case.ranks, fmt=case.fmt, files_per_rank=case.files_per_rank)
    return path


def assert_same_tensor(got: Any, want: torch.Tensor, where: str) -> None:
    assert isinstance(got, torch.Tensor), f"{where}: {type(got).__name__}, not a tensor"
    assert (got.dtype, tuple(got.shape)) == (want.dtype, tuple(want.shape)), \
        f"{where}: {got.dtype} {list(got.shape)}, saved {want.dtype} {list(want.shape)}"
    if not same_bits(got, want):
        a, b = (t.detach().contiguous().reshape(-1).view(torch.uint8) for t in (got, want))
        bad = (a != b).nonzero().flatten()
        first = int(bad[0]) // want.element_size()
        raise AssertionError(f"{where}: {len(bad)} of {b.numel()} bytes differ from what was saved "
                             f"(first in element {first} of {want.numel()})")


def assert_same_tree(got: Any, want: Any, what: str = "", path: tuple = ()) -> None:
    """Structure, container types, dtypes and every bit alike; failures name `what` and the fqn."""
    where = f"{what}: {'.'.join(map(str, path)) or '(root)'}"
    if isinstance(want, torch.Tensor):
        assert_same_tensor(got, want, where)
    elif isinstance(want, dict):
        keys = sorted(map(repr, got)) if isinstance(got, dict) else type(got)
        assert keys == sorted(map(repr, want)), f"{where}: keys {keys}, saved {sorted(map(repr, want))}"
        for key in want:
            assert_same_tree(got[key], want[key], what, (*path, key))
    elif isinstance(want, list) and any(isinstance(v, (dict, list, torch.Tensor)) for v in want):
        assert isinstance(got, list) and len(got) == len(want), f"{where}: {got!r}, saved {want!r}"
        for i, (g, w) in enumerate(zip(got, want)):
            assert_same_tree(g, w, what, (*path, i))
    else:
        assert type(got) is type(want) and got == want, f"{where}: {got!r}, saved {want!r}"


def load_template(spec: StateSpec) -> dict:
    """The state dict `dcp.load` fills (no_dist: whole tensors): every tensor its shape and dtype, each
    byte 0xA5; every plain value a sentinel."""
    return build_state_dict(spec, lambda entry, full: unloaded_like(full), lambda entry: NOT_LOADED)


def dcp_load(ckpt: Path, template: dict) -> dict:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(template, storage_reader=FileSystemReader(str(ckpt)), no_dist=True)
    return template


def read_metadata(ckpt: Path):
    from torch.distributed.checkpoint import FileSystemReader

    return FileSystemReader(str(ckpt)).read_metadata()


def assert_fsdp2_layout(ckpt: Path, tensors: dict[str, torch.Tensor], values: set[str], n: int,
                        planner_data: Any = None) -> None:
    """torch's `read_metadata` of `ckpt` describes FSDP2's save at `n` ranks: each tensor's non-empty
    chunk boxes are rank r's rows [r*c, min(R, (r+1)*c)), c = ceil(R/n), in `__r_0.distcp`; a 0-d
    tensor one chunk, plain values bytes items, both in rank 0's file; every storage entry inside
    its file."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex, TensorStorageMetadata

    md = read_metadata(ckpt)
    assert sorted(md.state_dict_metadata) == sorted([*tensors, *values])
    if planner_data is not None:
        assert md.planner_data == planner_data
    for fqn in values:
        assert isinstance(md.state_dict_metadata[fqn], BytesStorageMetadata), fqn
        where = md.storage_data[MetadataIndex(fqn)].relative_path
        assert where == "__0_0.distcp", f"{fqn}: bytes item in {where} at {n} ranks, not rank 0's file"
    for fqn, tensor in tensors.items():
        meta = md.state_dict_metadata[fqn]
        assert isinstance(meta, TensorStorageMetadata), fqn
        assert (meta.properties.dtype, tuple(meta.size)) == (tensor.dtype, tuple(tensor.shape)), fqn
        boxes = [(tuple(c.offsets), tuple(c.sizes)) for c in meta.chunks]
        if tensor.dim() == 0:
            assert boxes == [((), ())], (fqn, boxes)
            where = md.storage_data[MetadataIndex(fqn, torch.Size([]))].relative_path
            assert where == "__0_0.distcp", f"{fqn}: 0-d tensor in {where} at {n} ranks, not rank 0's file"
            continue
        rows, rest = tensor.shape[0], tuple(tensor.shape[1:])
        want = {}
        for rank in range(n):
            lo, hi = row_range(rows, n, rank)
            if hi > lo and tensor.numel():
                want[(lo, *(0,) * len(rest))] = ((hi - lo, *rest), f"__{rank}_0.distcp")
        got = {off: size for off, size in boxes if torch.Size(size).numel()}
        assert got == {off: size for off, (size, _) in want.items()}, \
            f"{fqn} {list(tensor.shape)} at {n} ranks: chunks {boxes}, FSDP2 saves {sorted(want.items())}"
        for off, size in boxes:  # empty chunks are allowed (FSDP2 writes them), inside the tensor
            assert len(off) == len(size) == tensor.dim() and all(
                0 <= o and o + s <= d for o, s, d in zip(off, size, tensor.shape)), (fqn, boxes)
        for off, (_, name) in want.items():
            where = md.storage_data[MetadataIndex(fqn, torch.Size(off))].relative_path
            assert where == name, f"{fqn} rows from {off[0]} at {n} ranks: in {where}, FSDP2's rank file is {name}"
    for index, info in md.storage_data.items():
        path = ckpt / info.relative_path
        assert path.is_file(), f"{index.fqn}: {info.relative_path} missing"
        assert 0 <= info.offset and info.offset + info.length <= os.path.getsize(path), \
            f"{index.fqn}: bytes {info.offset}+{info.length} past the end of {info.relative_path}"


def assert_source_is(src: Path, case: Case, saved: dict) -> None:
    """The oracle first: the source holds the state dict built (else the test, not ckptctl, is wrong).
    torch's FileSystemReader cannot read its own SAFETENSORS saves (it torch.loads every item;
    HuggingFaceStorageReader reads safetensors files, not DCP): there each chunk is read from its
    file's blob with the safetensors library."""
    if case.fmt != "safetensors":
        assert_same_tree(dcp_load(src, load_template(case.spec)), saved, "source")
        return
    from safetensors.torch import load as load_safetensors
    from torch.distributed.checkpoint.metadata import MetadataIndex

    md = read_metadata(src)
    tensors, _ = flat_entries(case.spec, saved)
    blobs: dict[tuple[str, int], dict] = {}
    for fqn, tensor in tensors.items():
        for chunk in md.state_dict_metadata[fqn].chunks:
            info = md.storage_data[MetadataIndex(fqn, chunk.offsets)]
            if (info.relative_path, info.offset) not in blobs:
                blobs[info.relative_path, info.offset] = load_safetensors(
                    (src / info.relative_path).read_bytes()[info.offset:])
            want = tensor
            for dim, (lo, size) in enumerate(zip(chunk.offsets, chunk.sizes)):
                want = want.narrow(dim, lo, size)
            assert_same_tensor(blobs[info.relative_path, info.offset][fqn], want,
                               f"source {fqn} {list(chunk.offsets)}")
    _note(f"source: {len(blobs)} safetensors blobs, {sum(map(len, blobs.values()))} tensors")


def flat_entries(spec: StateSpec, state: dict) -> tuple[dict[str, torch.Tensor], set[str]]:
    tensors, values = {}, set()
    for entry in spec.entries:
        if isinstance(entry, TensorSpec):
            node = state
            for key in entry.path:
                node = node[key]
            tensors[entry.fqn] = node
        else:
            values.add(entry.fqn)
    return tensors, values


# ---------------------------------------------------------------------------------------------
# reshard


def check_reshard(case: Case, savers: SaverPool, workdirs: Workdir, cli: bool = False) -> None:
    record(case)
    _note(f"source: torch's dcp.save of the spec at {case.ranks} ranks, {case.fmt}, "
          f"{case.files_per_rank} file(s) a rank")
    with workdirs as root:
        src = save_case(case, root / "src", savers)
        saved = build_state_dict(case.spec)
        tensors, values = flat_entries(case.spec, saved)
        assert_source_is(src, case, saved)
        planner_data = read_metadata(src).planner_data
        for n in case.ns:
            dst = root / f"ws{n}"
            _note(f"ckptctl reshard SRC DST --world-size {n}")
            if cli:
                result = run_cli("reshard", src, dst, "--world-size", n, "-q")
                assert result.returncode == 0, result.stderr
            else:
                ckptctl.reshard(src, dst, ckptctl.ReshardOptions(world_size=n, workers=2))
            assert_fsdp2_layout(dst, tensors, values, n, planner_data)
            assert_same_tree(dcp_load(dst, load_template(case.spec)), saved,
                             f"reshard to {n} ranks, read by dcp.load")
            if n <= POOL_RANKS:  # and as FSDP2 loads it: n ranks, each into its DTensor shards
                _event("loaded by DTensors at N ranks")
                savers.load(case.spec, dst, ranks=n)
            shutil.rmtree(dst)


# Bounded (make test): derandomized, so CI draws the same examples every run; the wide matrices
# (make test-full) draw far more, N up to 1024. Examples cost ~0.3 s a reshard, ~0.05 s an export.
MATRIX = settings(max_examples=25, deadline=None, derandomize=True, database=None, print_blob=False,
                  suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                         HealthCheck.large_base_example])
MATRIX_CHEAP = settings(MATRIX, max_examples=40)
WIDE = settings(MATRIX, max_examples=300)
WIDE_CHEAP = settings(MATRIX, max_examples=600)


@MATRIX
@example(case=Case(LLAMA, ranks=4, fmt="torch_save", ns=(56, 57, 100, 128, 256)))  # .metadata into the wrong rank file
@example(case=Case(LLAMA, ranks=1, fmt="safetensors", ns=(2, 56)))
@example(case=Case(SEVERAL_PER_FILE, ranks=1, fmt="safetensors", ns=(1, 3)))  # read as the first tensor's bytes
@example(case=Case(SEVERAL_PER_FILE, ranks=2, fmt="safetensors", ns=(1, 5)))
@example(case=Case(SEVERAL_PER_FILE, ranks=3, fmt="zstd", ns=(4, 97), files_per_rank=2))
@example(case=Case(EDGES, ranks=4, fmt="safetensors", ns=(1, 2, 7)))
@example(case=Case(EDGES, ranks=3, fmt="torch_save", ns=(4, 300)))
@every_source_kind(lambda ranks, i: ((ranks + i) % 4 + 1, (3, 56, 129)[i]))
@given(case=cases())
def test_reshard_output_is_what_torch_saved_and_fsdp2s_layout(case, savers, workdirs):
    check_reshard(case, savers, workdirs)


@pytest.mark.full
@WIDE
@given(case=cases(wide=True))
def test_reshard_output_is_what_torch_saved_and_fsdp2s_layout_wide(case, savers, workdirs):
    check_reshard(case, savers, workdirs)


def test_the_reshard_command_writes_what_torch_reads_back(savers, workdirs):
    """The command line, not only the library: a SAFETENSORS save at 2 ranks to 57 ranks."""
    check_reshard(Case(LLAMA, ranks=2, fmt="safetensors", ns=(57,)), savers, workdirs, cli=True)


# ---------------------------------------------------------------------------------------------
# export-torch, export-hf --arch raw


def check_exports(case: Case, savers: SaverPool, workdirs: Workdir, shard_size: str = "5GB",
                  cli: bool = False) -> None:
    """export-torch: torch.load of the file is torch's own dcp_to_torch_save of the source, and the
    state dict saved; export-hf --arch raw: safetensors reads the model tensors saved (in files of
    at most `shard_size`)."""
    from safetensors.torch import load_file
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    record(case, world_sizes=False)
    _event(f"export-hf --max-shard-size {shard_size}")
    with workdirs as root:
        src = save_case(case, root / "src", savers)
        saved = build_state_dict(case.spec)

        out = root / "out.pt"
        if cli:
            result = run_cli("export-torch", src, out, "-q")
            assert result.returncode == 0, result.stderr
        else:
            ckptctl.export_torch(src, out, ckptctl.ExportTorchOptions(workers=2))
        ours = torch.load(out, weights_only=True)
        assert_same_tree(ours, saved, "export-torch")
        if case.fmt != "safetensors":  # torch's converter cannot read its SAFETENSORS saves (assert_source_is)
            dcp_to_torch_save(src, root / "torch.pt")
            assert_same_tree(ours, torch.load(root / "torch.pt", weights_only=True), "export-torch against torch's")

        model = saved.get("model", {})
        if not model:
            return
        ref = root / "ref"
        ref.mkdir()
        (ref / "config.json").write_text(json.dumps({"model_type": "raw"}))
        hf = root / "hf"
        if cli:
            result = run_cli("export-hf", src, hf, "--hf-config", ref, "--arch", "raw", "--no-name-check",
                             "--max-shard-size", shard_size, "-q")
            assert result.returncode == 0, result.stderr
        else:
            ckptctl.export_hf(src, hf, ref, ckptctl.ExportOptions(arch="raw", name_check=False, workers=2,
                                                                  max_shard_size=shard_size))
        exported = {}
        for file in sorted(hf.glob("*.safetensors")):
            exported.update(load_file(file))
        _event(f"export-hf files={len(list(hf.glob('*.safetensors')))}")
        assert_same_tree(exported, model, "export-hf")
        if (hf / "model.safetensors.index.json").exists():  # the index names each tensor's file
            weight_map = json.loads((hf / "model.safetensors.index.json").read_text())["weight_map"]
            assert sorted(weight_map) == sorted(model)
            for name, file in weight_map.items():
                assert name in load_file(hf / file), f"export-hf: index puts {name} in {file}, which lacks it"


SHARD_SIZES = st.sampled_from(["5GB", "5GB", "2000"])  # "2000": a safetensors file for about each tensor


@MATRIX_CHEAP
@example(case=Case(SEVERAL_PER_FILE, ranks=1, fmt="safetensors"), shard_size="5GB")  # read as the first tensor's bytes
@example(case=Case(SEVERAL_PER_FILE, ranks=2, fmt="safetensors"), shard_size="2000")
@example(case=Case(EDGES, ranks=3, fmt="zstd", files_per_rank=2), shard_size="5GB")
@every_source_kind(shard_size="2000")
@given(case=cases(), shard_size=SHARD_SIZES)
def test_exports_are_what_torch_saved(case, shard_size, savers, workdirs):
    check_exports(case, savers, workdirs, shard_size)


@pytest.mark.full
@WIDE_CHEAP
@given(case=cases(wide=True), shard_size=SHARD_SIZES)
def test_exports_are_what_torch_saved_wide(case, shard_size, savers, workdirs):
    check_exports(case, savers, workdirs, shard_size)


def test_the_export_commands_write_what_torch_and_safetensors_read_back(savers, workdirs):
    check_exports(Case(LLAMA, ranks=3, fmt="safetensors"), savers, workdirs, "20000", cli=True)


# ---------------------------------------------------------------------------------------------
# import-hf


@dataclass(frozen=True)
class HfCase:
    """A safetensors file written by the safetensors library, imported at each of `ns` ranks; the
    spec's paths are ("model", HF name), the fqns `import-hf` writes."""

    spec: StateSpec
    ns: tuple[int, ...]


def hf_spec(spec: StateSpec, seed: int) -> StateSpec:
    """`spec`'s tensors under HF names (the last part of each path), behind import-hf's `model.`."""
    return StateSpec(tuple(TensorSpec(("model", e.path[-1]), e.shape, e.dtype) for e in spec.tensors), seed=seed)


def hf_weights(spec: StateSpec) -> dict[str, torch.Tensor]:
    return build_state_dict(spec)["model"]


@st.composite
def hf_cases(draw, wide: bool = False) -> HfCase:
    count = draw(st.integers(1, 5))
    tensors = [draw(tensor_specs(("model", f"model.layers.{i}.{draw(_names)}"),
                                 dtype=draw(st.sampled_from(["float32", "bfloat16", "float16", "int64"]))))
               for i in range(count)]
    if draw(st.booleans()):
        tensors.append(TensorSpec(("model", "model.scale"), (), "float32"))
    return HfCase(StateSpec(tuple(tensors), seed=draw(st.integers(0, 2**16))), draw(world_sizes(wide)))


def write_hf_folder(folder: Path, weights: dict[str, torch.Tensor]) -> Path:
    from safetensors.torch import save_file

    folder.mkdir()
    save_file(weights, folder / "model.safetensors")
    (folder / "config.json").write_text(json.dumps({"model_type": "raw"}))
    return folder


def check_import(case: HfCase, savers: SaverPool, workdirs: Workdir, cli: bool = False) -> None:
    _event(f"tensors={len(case.spec.entries)}")
    for n in case.ns:
        _event(f"N={n_label(n)}")
    with workdirs as root:
        hf = write_hf_folder(root / "hf", hf_weights(case.spec))
        saved = build_state_dict(case.spec)
        tensors, _ = flat_entries(case.spec, saved)
        for n in case.ns:
            dst = root / f"ws{n}"
            _note(f"ckptctl import-hf HF DST --world-size {n} --no-name-check")
            if cli:
                result = run_cli("import-hf", hf, dst, "--world-size", n, "--no-name-check", "-q")
                assert result.returncode == 0, result.stderr
            else:
                ckptctl.import_hf(hf, dst, ckptctl.ImportOptions(world_size=n, name_check=False, workers=2))
            assert_fsdp2_layout(dst, tensors, set(), n)
            assert_same_tree(dcp_load(dst, load_template(case.spec)), saved,
                             f"import-hf at {n} ranks, read by dcp.load")
            if n <= POOL_RANKS:
                _event("loaded by DTensors at N ranks")
                savers.load(case.spec, dst, ranks=n)
            shutil.rmtree(dst)


@MATRIX_CHEAP
@example(case=HfCase(hf_spec(LLAMA_MODEL, seed=3), ns=(1, 4, 56, 57)))
@example(case=HfCase(hf_spec(EDGES, seed=4), ns=(2, 7)))
@given(case=hf_cases())
def test_import_hf_output_is_what_safetensors_holds(case, savers, workdirs):
    check_import(case, savers, workdirs)


@pytest.mark.full
@WIDE
@given(case=hf_cases(wide=True))
def test_import_hf_output_is_what_safetensors_holds_wide(case, savers, workdirs):
    check_import(case, savers, workdirs)


def test_the_import_command_writes_what_torch_reads_back(savers, workdirs):
    check_import(HfCase(hf_spec(SEVERAL_PER_FILE, seed=5), ns=(3,)), savers, workdirs, cli=True)


def test_import_hf_output_nests_as_torchs_own_save_of_the_model(workdirs):
    """README: the names as `dcp.save({"model": model.state_dict()})` writes them. torch's writer also
    records each fqn's path (`planner_data`), by which its dcp_to_torch_save and
    `_load_state_dict_from_keys` nest the state dict; both checkpoints must convert alike."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    weights = hf_weights(hf_spec(SEVERAL_PER_FILE, seed=6))
    with workdirs as root:
        hf = write_hf_folder(root / "hf", weights)
        ckptctl.import_hf(hf, root / "ours", ckptctl.ImportOptions(world_size=2, name_check=False, workers=2))
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.save({"model": weights}, checkpoint_id=root / "torch", no_dist=True)
        for name in ("ours", "torch"):
            dcp_to_torch_save(root / name, root / f"{name}.pt")
        theirs = torch.load(root / "torch.pt", weights_only=True)
        assert_same_tree(theirs, {"model": weights}, "torch's save")
        ours = torch.load(root / "ours.pt", weights_only=True)
        assert read_metadata(root / "ours").planner_data == read_metadata(root / "torch").planner_data, \
            f"planner_data: dcp_to_torch_save of import-hf's output has keys {sorted(ours)[:3]}..., " \
            f"of torch's {sorted(theirs)}"
        assert_same_tree(ours, theirs, "dcp_to_torch_save of import-hf's output")


# ---------------------------------------------------------------------------------------------
# the pool itself


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ", 1)[1].startswith("Z")  # a zombie is gone, only not yet reaped
    except FileNotFoundError:
        return True


def test_the_pool_reports_failures_and_replaces_ranks_stuck_in_a_collective(tmp_path):
    bad = StateSpec((TensorSpec(("model", "w"), (4, 2), "no_such_dtype"),))
    good = StateSpec((TensorSpec(("model", "w"), (5, 2), "float32"), ValueSpec(("step",), 3)))
    with SaverPool(2) as pool:
        pool.save(good, tmp_path / "good", ranks=2, fmt="torch_save")
        first = pool.pids
        with pytest.raises(SaveError) as err:  # both ranks raise, and answer: the pool is kept
            pool.save(bad, tmp_path / "bad", ranks=2, fmt="torch_save")
        assert "no_such_dtype" in str(err.value) and "--- rank 1 ---" in str(err.value) and err.value.healthy
        with pytest.raises(SaveError) as err:  # a load that finds other data than the spec's
            pool.load(StateSpec(good.entries, seed=1), tmp_path / "good", ranks=2)
        assert "model.w [5, 2]: loaded shard" in str(err.value)
        pool.load(good, tmp_path / "good", ranks=2)
        assert pool.pids == first
        with pytest.raises(SaveError) as err:  # rank 0 alone in a save over 2 ranks: stuck in a collective
            pool._run("stuck", ("save", good, str(tmp_path / "stuck"), 2, "torch_save", 1), 2, timeout=2.0, send_to=[0])
        assert "no answer from ranks [0, 1] after 2s" in str(err.value) and not err.value.healthy
        assert pool.pids == [] and all(map(_gone, first))
        pool.save(good, tmp_path / "again", ranks=1, fmt="zstd")
        assert pool.starts == 2
        second = pool.pids
    assert all(map(_gone, second))
    assert_same_tree(dcp_load(tmp_path / "good", load_template(good)), build_state_dict(good))
