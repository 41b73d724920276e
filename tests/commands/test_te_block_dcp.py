"""DCP items holding Transformer Engine's block-scaled tensors (`fixtures.te_blocks_dcp`: stand-ins
following TE's source, FSDP2's dim-0 shards as DTensors at 2 gloo ranks, each with its own
scales): MXFP8Tensor (e4m3, e5m2), Float8BlockwiseQTensor (1×128 and 128×128 blocks), NVFP4Tensor
(per-tensor amax, and per-row amax with e4m3_max 256), and TE ≤ 2.15's forms.

Oracle: TE's dequantize math element by element (`reference_*`, see `test_te_block_dequant`);
`diff` and the output checks reading the items with their own decoders; `--verify`'s torch
loader with the stand-ins allowed under TE's names.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from ckptctl.formats.pickle.subclass import Float8RecordSpec
from ckptctl.formats.pickle.te_blocks import BlockScaledRecordSpec
from ckptctl.formats.pickle.unpickle import MalformedPickleError, TensorRecordSpec, UnsafePickleError, \
    load_tensor_record_spec
from fixtures import te_blocks_dcp
from tests.commands.test_fp8_dcp_subclasses import _item_pickle, refused_mutants
from tests.conftest import run_cli

safetensors_torch = pytest.importorskip("safetensors.torch")
pytest.importorskip("transformers")

MX_E4M3 = ("transformer_engine MXFP8Tensor: float8_e4m3fn data, E8M0 scales [128, 4] per 1×32 block, "
           "logical bfloat16")
MX_E5M2 = ("transformer_engine MXFP8Tensor: float8_e5m2 data, E8M0 scales [128, 4] per 1×32 block, "
           "logical bfloat16")
BLOCK_2D = ("transformer_engine Float8BlockwiseQTensor: float8_e4m3fn data, float32 scales [1, 4] per 128×128 block, "
            "logical bfloat16")
BLOCK_1D = ("transformer_engine Float8BlockwiseQTensor: float8_e4m3fn data, float32 scales [1, 64] per 1×128 block, "
            "logical bfloat16")
NVFP4 = ("transformer_engine NVFP4Tensor: e2m1 data (two a byte), E4M3 scales [128, 4] per 1×16 block × float32 "
         "amax / (6 × 448), logical bfloat16")
NVFP4_ROWS = ("transformer_engine NVFP4Tensor: e2m1 data (two a byte), E4M3 scales [128, 4] per 1×16 block × "
              "float32 amax per row / (6 × 256), logical bfloat16")
LAYER = "model.model.layers.0."


@pytest.fixture(scope="module")
def te_saved(tmp_path_factory) -> tuple[Path, Path, dict[str, torch.Tensor]]:
    root = tmp_path_factory.mktemp("te_blocks")
    values = te_blocks_dcp.save(str(root / "ckpt"))
    te_blocks_dcp.config().save_pretrained(root / "cfg")
    return root / "ckpt", root / "cfg", values


def _exports_as_te_dequantizes(ckpt: Path, cfg: Path, values: dict[str, torch.Tensor], out: Path) -> None:
    done = run_cli("export-hf", ckpt, out, "--hf-config", cfg, "--verify")
    assert done.returncode == 0, done.stderr
    got = safetensors_torch.load_file(out / "model.safetensors")
    assert sorted(got) == sorted(values)
    for name, value in values.items():
        assert got[name].dtype == torch.bfloat16, name
        assert torch.equal(got[name].view(torch.int16), value.view(torch.int16)), name
    same = run_cli("diff", ckpt, out)
    assert same.returncode == 0 and "12 tensors: 12 equal, 0 close, 0 differs" in same.stdout, same.stdout + same.stderr


def test_export_hf_and_diff_dequantize_as_te_does(te_saved, tmp_path):
    """The essential proof: every projection bit-equal to TE's math on each rank's shard."""
    ckpt, cfg, values = te_saved
    assert torch.isinf(values["model.layers.0.mlp.down_proj.weight"].float()).any()  # E8M0 254 over the maxima
    _exports_as_te_dequantizes(ckpt, cfg, values, tmp_path / "hf")


def test_inspect_shows_te_block_kinds(te_saved):
    shown = run_cli("inspect", te_saved[0])
    assert shown.returncode == 0, shown.stderr
    assert (f"Subclasses        1 tensor: {BLOCK_2D}\n                  1 tensor: {BLOCK_1D}\n"
            f"                  2 tensors: {MX_E4M3}\n                  1 tensor: {MX_E5M2}\n"
            f"                  1 tensor: {NVFP4}\n                  1 tensor: {NVFP4_ROWS}\n") in shown.stdout
    doc = json.loads(run_cli("inspect", te_saved[0], "--json", "--filter", "*layers*").stdout)
    assert doc["subclasses"] == {f"{LAYER}self_attn.q_proj.weight": MX_E4M3, f"{LAYER}self_attn.k_proj.weight": MX_E5M2,
                                 f"{LAYER}self_attn.v_proj.weight": NVFP4, f"{LAYER}self_attn.o_proj.weight": BLOCK_2D,
                                 f"{LAYER}mlp.gate_proj.weight": BLOCK_1D, f"{LAYER}mlp.up_proj.weight": NVFP4_ROWS,
                                 f"{LAYER}mlp.down_proj.weight": MX_E4M3}


def test_items_decode_to_their_records(te_saved):
    ckpt = te_saved[0]
    nvfp4 = load_tensor_record_spec(_item_pickle(ckpt, f"{LAYER}mlp.up_proj.weight", rank=1))
    assert type(nvfp4) is BlockScaledRecordSpec and nvfp4.size == (64, 64) and nvfp4.dtype.name == "bfloat16"
    assert (nvfp4.scaling.block, nvfp4.scaling.e4m3_max, nvfp4.scaling.row_amax) == ((1, 16), 256, True)
    assert [(r.dtype.name, r.size) for r in nvfp4.records()] == [("uint8", (64, 32)), ("uint8", (128, 4)),
                                                                 ("float32", (64,))]
    block = load_tensor_record_spec(_item_pickle(ckpt, f"{LAYER}mlp.gate_proj.weight"))
    assert (block.scaling.block, block.scaling.codes, block.scales.size) == ((1, 128), "float8_e4m3fn", (1, 64))


def test_reshard_refuses_nvfp4_by_name(te_saved, tmp_path):
    """NVFP4 is refused at planning, before any file is written."""
    ckpt = te_saved[0]
    kept = "reshard keeps TE's Float8Tensor, MXFP8Tensor and Float8BlockwiseQTensor items, not NVFP4Tensor's yet"
    done = run_cli("reshard", ckpt, tmp_path / "out", "--world-size", "1")
    assert done.returncode == 2
    assert done.stderr == (f"ckptctl: error: {LAYER}mlp.up_proj.weight: a {NVFP4_ROWS.replace(': ', ' (', 1)}): "
                           f"{kept} (export-hf dequantizes it)\n")
    done = run_cli("reshard", ckpt, tmp_path / "out", "--world-size", "3", "--include", "*v_proj*")
    assert done.returncode == 2
    assert done.stderr == (f"ckptctl: error: {LAYER}self_attn.v_proj.weight: a {NVFP4.replace(': ', ' (', 1)}): "
                           f"{kept} (export-hf dequantizes it)\n")
    assert not (tmp_path / "out").exists()


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def _expected_scales(kind: str, saved: list, start: int, stop: int) -> torch.Tensor:
    """A kept chunk's rowwise scales by TE's layout, from the saved shards' (each `rows` rows):
    MXFP8 its rows' scale rows then zero rows to 128; blockwise 1-D its rows' columns then zero
    columns to 4; 2-D the scale row of the saved 128×128 block its rows lie in."""
    rows, held = saved[0][0].shape[0], stop - start
    if kind == "mxfp8":
        full = torch.cat([scales[:rows] for _, scales, _ in saved])
        out = torch.zeros((_round_up(held, 128), full.shape[1]), dtype=torch.uint8)
        out[:held] = full[start:stop]
        return out
    if kind == "block1d":
        full = torch.cat([scales[:, :rows] for _, scales, _ in saved], dim=1)
        out = torch.zeros((full.shape[0], _round_up(held, 4)), dtype=torch.float32)
        out[:, :held] = full[:, start:stop]
        return out
    shard = start // rows
    assert (stop - 1) // rows == shard and held <= 128
    return saved[shard][1][(start - shard * rows) // 128:][:1]


def _reshards_exactly(te_saved, out: Path, world_size: int, leaves: dict[str, tuple[int, str, int]]) -> None:
    """Resharded with --verify, torch's dcp.load at `world_size` ranks gives every rank TE's
    reduce form again (leaf → rows, kind, TE DType): its rows' codes bit for bit, its scales as
    `_expected_scales` says, the saved quantizer's fields, no columnwise copy; the dequantized
    values equal the source's."""
    ckpt = te_saved[0]
    done = run_cli("reshard", ckpt, out, "--world-size", str(world_size),
                   *(a for leaf in leaves for a in ("--include", f"*{leaf}*")), "--verify")
    assert done.returncode == 0, done.stderr
    loaded = te_blocks_dcp.load_kept(str(out), world_size, tuple(leaves))
    for leaf, (rows, kind, dtype) in leaves.items():
        step = -(-rows // world_size)
        for rank, shards in enumerate(loaded):
            (got,) = [v for k, v in shards.items() if k.endswith(f".{leaf}.weight")]
            start, stop = min(rows, rank * step), min(rows, (rank + 1) * step)
            assert got["rows"] == (start, stop) and got["kind"] == kind
            args, saved = got["args"], got["saved"]
            if kind == "mxfp8":
                codes, scales, rest = args[0], args[1], (args[2:6], tuple(args[6]), args[8], len(args))
                want = ((None, None, dtype, torch.bfloat16), (stop - start, args[6][1]), False, 9)
                quantizer = args[7]
            else:
                codes, scales, rest = args[1], args[2], (args[3:7], tuple(args[0]), args[8:], len(args))
                want = ((None, None, dtype, torch.bfloat16), (stop - start, args[0][1]), (kind == "block2d", None), 10)
                quantizer = args[7]
            assert rest == want, (leaf, rank)
            assert quantizer == saved[0][2] and quantizer["dtype"] == dtype and quantizer["columnwise_usage"] is True
            assert torch.equal(codes, torch.cat([c for c, _, _ in saved])[start:stop]), (leaf, rank)
            expected = _expected_scales(kind, saved, start, stop)
            assert scales.dtype == expected.dtype and scales.shape == expected.shape, (leaf, rank)
            bits = torch.int32 if expected.dtype == torch.float32 else torch.uint8
            assert torch.equal(scales.view(bits), expected.view(bits)), (leaf, rank)
    same = run_cli("diff", ckpt, out)
    count = f"{len(leaves)} tensor{'s' if len(leaves) > 1 else ''}"
    assert f"{count}: {len(leaves)} equal, 0 close, 0 differs; {12 - len(leaves)} only in A" in same.stdout, same.stdout


MXFP8_LEAVES = {"q_proj": (64, "mxfp8", 7), "k_proj": (32, "mxfp8", 8), "down_proj": (64, "mxfp8", 7)}


def test_reshard_keeps_mxfp8_items_exactly_at_3_ranks(te_saved, tmp_path):
    """The essential proof: 2 → 3 ranks (22, 22, 20 rows), every rank's codes and scales kept."""
    _reshards_exactly(te_saved, tmp_path / "ws3", 3, MXFP8_LEAVES)


@pytest.mark.full
def test_reshard_keeps_mxfp8_items_exactly_at_1_rank(te_saved, tmp_path):
    _reshards_exactly(te_saved, tmp_path / "ws1", 1, MXFP8_LEAVES)


@pytest.mark.full
@pytest.mark.parametrize("world_size", [3, 1])
def test_reshard_keeps_1d_blockwise_items_exactly(te_saved, tmp_path, world_size):
    """1×128 blocks: a row's scales are its column of [⌈N/128⌉, round_up(M, 4)]; they follow it."""
    _reshards_exactly(te_saved, tmp_path / "out", world_size, {"gate_proj": (128, "block1d", 7)})


@pytest.mark.full
def test_reshard_keeps_2d_blockwise_items_within_saved_blocks(te_saved, tmp_path):
    """128×128 blocks, each saved shard (32 rows) one block: at 4 ranks every chunk (16 rows) lies in
    one saved block and keeps its scale row; at 3 ranks (rows [22, 44) join two) and at 1 it is
    refused, naming the chunk, before anything is written."""
    _reshards_exactly(te_saved, tmp_path / "ws4", 4, {"o_proj": (64, "block2d", 7)})
    for world_size, rows in ((3, "[22, 44)"), (1, "[0, 64)")):
        done = run_cli("reshard", te_saved[0], tmp_path / f"ws{world_size}", "--world-size", str(world_size),
                       "--include", "*o_proj*")
        assert done.returncode == 2 and not (tmp_path / f"ws{world_size}").exists()
        assert done.stderr == (f"ckptctl: error: {LAYER}self_attn.o_proj.weight: the target chunk of rows {rows}: its "
                               f"128-row block {rows} spans more than one saved 128×128 block, each of its own "
                               "scales; one scale for it would need requantizing (reshard to a world size whose "
                               "chunks keep within saved blocks, or export-hf it dequantized)\n")


def _record_at(ckpt: Path, fqn: str, key: str) -> int:
    """The file offset of storage record `key` of `fqn`'s item in rank 0's file (by torch's metadata and zipfile)."""
    import io
    import struct
    import zipfile

    from torch.distributed.checkpoint import FileSystemReader

    md = FileSystemReader(str(ckpt)).read_metadata()
    info = next(v for k, v in md.storage_data.items() if k.fqn == fqn and v.relative_path == "__0_0.distcp")
    item = (ckpt / info.relative_path).read_bytes()[info.offset:info.offset + info.length]
    record = next(i for i in zipfile.ZipFile(io.BytesIO(item)).infolist() if i.filename.endswith(f"/data/{key}"))
    name_len, extra_len = struct.unpack_from("<HH", item, record.header_offset + 26)
    return info.offset + record.header_offset + 30 + name_len + extra_len


def test_export_hf_refuses_a_nan_e8m0_scale(te_saved, tmp_path):
    """A scale TE's dequantize would spread NaN from is refused with the item and the tensor named."""
    import shutil

    ckpt = tmp_path / "ckpt"
    shutil.copytree(te_saved[0], ckpt)
    fqn = f"{LAYER}self_attn.q_proj.weight"
    spec = load_tensor_record_spec(_item_pickle(ckpt, fqn))
    at = _record_at(ckpt, fqn, spec.scales.storage_key) + 5 * 4 + 1  # row 5, block 1: inside the tensor
    with open(ckpt / "__0_0.distcp", "r+b") as f:
        f.seek(at)
        f.write(b"\xff")
    done = run_cli("export-hf", ckpt, tmp_path / "hf", "--hf-config", te_saved[1])
    assert done.returncode == 2 and done.stderr.startswith(f"ckptctl: error: {ckpt}/__0_0.distcp: item at byte ")
    assert done.stderr.endswith(f": {fqn}: MXFP8Tensor with a NaN E8M0 scale (code 255)\n"), done.stderr
    assert not (tmp_path / "hf").exists()


VARIANT_REFUSALS = {
    "swizzled": (UnsafePickleError, "Transformer Engine MXFP8Tensor with GEMM-swizzled scales"),
    "columnwise-only": (UnsafePickleError, "Transformer Engine MXFP8Tensor holding only its columnwise data"),
    "data-format": (UnsafePickleError, "Transformer Engine Float8BlockwiseQTensor with a data_format (GEMM-ready "
                                       "scales)"),
    "no-amax": (UnsafePickleError, "Transformer Engine NVFP4Tensor without its rowwise amax"),
    "unpadded-scales": (MalformedPickleError, "MXFP8Tensor rowwise scale_inv is [32, 2], TE allocates [128, 4]"),
    "odd-columns": (UnsafePickleError, "Transformer Engine MXFP8Tensor whose last dimension 48 is not a multiple "
                                       "of 32"),
    "foreign-quantizer": (UnsafePickleError, "MXFP8Quantizer field 'role' holds a list"),
}


@pytest.fixture(scope="module")
def variants() -> dict[str, bytes]:
    return te_blocks_dcp.variants()


@pytest.mark.parametrize("case", sorted(VARIANT_REFUSALS))
def test_states_te_can_pickle_but_this_cannot_read_are_refused_by_name(variants, case):
    error, line = VARIANT_REFUSALS[case]
    with pytest.raises(error) as refused:
        load_tensor_record_spec(variants[case])
    assert str(refused.value) == line


@pytest.mark.parametrize("fqn", [f"{LAYER}mlp.down_proj.weight", f"{LAYER}mlp.up_proj.weight",
                                 f"{LAYER}self_attn.o_proj.weight"])
def test_mutated_te_block_items_end_in_refusals_only(te_saved, fqn):
    """No neighbour of a real item escapes the decoder with anything but its refusals."""
    assert refused_mutants(_item_pickle(te_saved[0], fqn), (TensorRecordSpec, BlockScaledRecordSpec)) > 200


@pytest.mark.full
def test_te_2_15_forms(tmp_path):
    """TE ≤ 2.15: classmethod reconstructors through getattr, the pybind DType by NEWOBJ + BUILD,
    NVFP4 without its 2.17 arguments, and a per-tensor Float8Tensor by `Float8Tensor._make_in_reduce_ex`."""
    values = te_blocks_dcp.save(str(tmp_path / "ckpt"), release="2.15")
    te_blocks_dcp.config().save_pretrained(tmp_path / "cfg")
    shown = run_cli("inspect", tmp_path / "ckpt", "--json", "--filter", "*down_proj*")
    assert json.loads(shown.stdout)["subclasses"] == {
        f"{LAYER}mlp.down_proj.weight": "transformer_engine Float8Tensor: float8_e4m3fn data + float32 scale_inv, "
                                        "logical bfloat16"}
    _exports_as_te_dequantizes(tmp_path / "ckpt", tmp_path / "cfg", values, tmp_path / "hf")
    done = run_cli("reshard", tmp_path / "ckpt", tmp_path / "out", "--world-size", "3", "--include", "*q_proj*")
    assert done.returncode == 2 and not (tmp_path / "out").exists()
    assert done.stderr == (f"ckptctl: error: {LAYER}self_attn.q_proj.weight: MXFP8Tensor in TE ≤ 2.15's classmethod "
                           "form: reshard writes TE ≥ 2.16's items only (export-hf dequantizes it)\n")
    for fqn in (f"{LAYER}mlp.down_proj.weight", f"{LAYER}self_attn.q_proj.weight"):  # getattr, pybind DType
        assert refused_mutants(_item_pickle(tmp_path / "ckpt", fqn),
                               (TensorRecordSpec, BlockScaledRecordSpec, Float8RecordSpec)) > 200


@pytest.mark.full
def test_verify_refuses_an_mxfp8_item_with_another_scale(te_saved, tmp_path):
    """--verify's MXFP8 check decodes both sides by torch's loader: one scale byte changed in an
    output item (a value the default check might not sample) fails it, naming the rows."""
    from ckptctl.checks.float8_output import verify_float8
    from ckptctl.commands.reshard import ReshardOptions, plan_reshard
    from ckptctl.formats.dcp.items import ItemReader
    from ckptctl.formats.dcp.metadata import open_checkpoint
    from ckptctl.util.errors import CheckpointError

    out, fqn = tmp_path / "ws3", f"{LAYER}self_attn.q_proj.weight"
    assert run_cli("reshard", te_saved[0], out, "--world-size", "3", "--include", "*q_proj*").returncode == 0
    src, dst = open_checkpoint(te_saved[0]), open_checkpoint(out)
    target = plan_reshard(src, ReshardOptions(world_size=3, include=("*q_proj*",))).targets[fqn]
    with ItemReader(src) as src_items, ItemReader(dst) as dst_items:
        verify_float8(src, src_items, dst, dst_items, target, out)
    at = _record_at(out, fqn, "1") + 3 * 4  # row 3's first block
    with open(out / "__0_0.distcp", "r+b") as f:
        f.seek(at)
        kept = f.read(1)
        f.seek(at)
        f.write(bytes([kept[0] ^ 1]))
    with ItemReader(src) as src_items, ItemReader(open_checkpoint(out)) as dst_items:
        with pytest.raises(CheckpointError, match=r"the scales of the item at \[0, 0\], decoded by torch, are not its "
                                                  r"source rows' scales padded with zeros as TE pads them"):
            verify_float8(src, src_items, open_checkpoint(out), dst_items, target, out)
