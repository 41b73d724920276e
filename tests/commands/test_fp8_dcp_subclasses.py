"""DCP items holding FP8 training tensor subclasses (`fixtures.fp8_dcp`): torchao's float8 training
wrapper (the real torchao, under fully_shard) and Transformer Engine's Float8Tensor (a stand-in
following TE's source, its shards DTensors as FSDP2 leaves them, sharing one scale_inv as TE's
FSDP2 path saves them, or each with its own).

Oracles: torch's own `dcp.load` into the torchao-converted sharded model, and into Float8Tensor
(stand-in) shards at the new world size (reshard keeps values, codes and scales bit for bit);
TE's dequantize math (float32 code × scale_inv → bf16) per shard; transformers loading the
exported folder (plain, or FP8 dequantized on CPU), its logits equal to those of the reference
model holding the dequantized values; torch's `weights_only` loader (with the stand-ins allowed
under the producers' names) behind `--verify`, and behind export-torch's file.
"""

from __future__ import annotations

import io
import json
import zipfile
from pathlib import Path

import pytest
import torch

from ckptctl.formats.pickle.subclass import Float8RecordSpec, WrappedRecordSpec
from ckptctl.formats.pickle.unpickle import UnsafePickleError, load_tensor_record_spec
from fixtures import fp8_dcp
from fixtures.gloo import RankError
from tests.conftest import run_cli

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

TE_E4M3 = "transformer_engine Float8Tensor: float8_e4m3fn data + float32 scale_inv, logical bfloat16"
TE_E5M2 = "transformer_engine Float8Tensor: float8_e5m2 data + float32 scale_inv, logical bfloat16"
TORCHAO = "torchao.float8.fsdp_utils.WeightWithDynamicFloat8CastTensor (casts to float8_e4m3fn)"


@pytest.fixture(scope="module")
def te_ckpt(tmp_path_factory) -> tuple[Path, Path]:
    """Each rank's shard with its own scale_inv, two weights e5m2: every item decodes on its own."""
    root = tmp_path_factory.mktemp("te")
    fp8_dcp.save_te(str(root / "ckpt"), scales="per-shard", formats="mixed")
    fp8_dcp.te_config().save_pretrained(root / "cfg")
    return root / "ckpt", root / "cfg"


@pytest.fixture(scope="module")
def te_shared(tmp_path_factory) -> Path:
    """One scale_inv for all shards of a parameter, as TE's FSDP2 path saves them, weights e4m3 (TE's recipes)."""
    path = tmp_path_factory.mktemp("te-shared") / "ckpt"
    fp8_dcp.save_te(str(path))
    return path


@pytest.fixture(scope="module")
def torchao_saved(tmp_path_factory) -> tuple[Path, dict[str, torch.Tensor]]:
    if not fp8_dcp.torchao_available():
        pytest.skip("torchao not installed (make oracles puts it beside the venv)")
    path = tmp_path_factory.mktemp("torchao") / "ckpt"
    kinds, saved = fp8_dcp.save_torchao(str(path))
    assert kinds == ["0.weight:WeightWithDynamicFloat8CastTensor", "1.bias:Tensor",
                     "1.weight:WeightWithDynamicFloat8CastTensor"]
    return path, saved


@pytest.fixture(scope="module")
def torchao_ckpt(torchao_saved) -> Path:
    return torchao_saved[0]


def _item_pickle(ckpt: Path, fqn: str, rank: int = 0) -> bytes:
    """The `data.pkl` of `fqn`'s item in rank `rank`'s file, read with torch's own metadata loader."""
    from torch.distributed.checkpoint import FileSystemReader

    md = FileSystemReader(str(ckpt)).read_metadata()
    info = next(v for k, v in md.storage_data.items() if k.fqn == fqn and v.relative_path == f"__{rank}_0.distcp")
    item = (ckpt / info.relative_path).read_bytes()[info.offset:info.offset + info.length]
    archive = zipfile.ZipFile(io.BytesIO(item))
    return archive.read(next(n for n in archive.namelist() if n.endswith("data.pkl")))


def test_te_item_decodes_to_codes_and_scale(te_ckpt):
    spec = load_tensor_record_spec(_item_pickle(te_ckpt[0], "model.model.layers.0.self_attn.v_proj.weight", rank=1))
    assert type(spec) is Float8RecordSpec
    assert (spec.fp8.name, spec.dtype.name, spec.size) == ("float8_e5m2", "bfloat16", (4, 16))
    assert (spec.data.dtype.name, spec.data.size, spec.data.storage_numel) == ("uint8", (4, 16), 64)
    assert (spec.scale_inv.dtype.name, spec.scale_inv.size) == ("float32", (1,))


def test_te_item_naming_another_reconstructor_is_refused(te_ckpt):
    """Only TE's known constructor is allowed: the same item naming any other is refused by name."""
    pickled = _item_pickle(te_ckpt[0], "model.model.layers.0.self_attn.q_proj.weight")
    other = pickled.replace(b"_make_float8_tensor_in_reduce_ex", b"_make_mxfp8_tensor_in_reduce_ex_")
    with pytest.raises(UnsafePickleError, match=r"^refuses to load global transformer_engine\.pytorch\.tensor\."
                                                r"float8_tensor\._make_mxfp8_tensor_in_reduce_ex_$"):
        load_tensor_record_spec(other)


def test_te_item_with_its_transpose_is_refused_by_name(te_ckpt):
    """TE's current `__reduce_ex__` passes `data_transpose` only for a tensor holding its transpose
    alone; such an item (its sixth argument a tensor) is refused, by name, not rewritten."""
    import pickletools

    pickled = _item_pickle(te_ckpt[0], "model.model.layers.0.self_attn.q_proj.weight")
    ops = list(pickletools.genops(pickled))
    first = next(i for i, (op, _, _) in enumerate(ops) if op.name == "REDUCE")
    data_memo = ops[first + 1][1]  # the memo index of `data`, the first tensor rebuilt
    at = pickled.rindex(b"Nt")
    transposed = pickled[:at] + b"h" + bytes([data_memo]) + pickled[at + 1:]
    with pytest.raises(UnsafePickleError, match=r"^Transformer Engine Float8Tensor holding only its transpose"):
        load_tensor_record_spec(transposed)


def test_inspect_shows_te_float8(te_ckpt):
    shown = run_cli("inspect", te_ckpt[0])
    assert shown.returncode == 0, shown.stderr
    assert f"Subclasses        5 tensors: {TE_E4M3}\n                  2 tensors: {TE_E5M2}\n" in shown.stdout
    doc = json.loads(run_cli("inspect", te_ckpt[0], "--json", "--filter", "*self_attn*").stdout)
    assert doc["subclasses"] == {"model.model.layers.0.self_attn.q_proj.weight": TE_E4M3,
                                 "model.model.layers.0.self_attn.k_proj.weight": TE_E4M3,
                                 "model.model.layers.0.self_attn.v_proj.weight": TE_E5M2,
                                 "model.model.layers.0.self_attn.o_proj.weight": TE_E4M3}


def test_export_hf_dequantizes_te_float8_as_te_does(te_ckpt, tmp_path):
    ckpt, cfg = te_ckpt
    done = run_cli("export-hf", ckpt, tmp_path / "hf", "--hf-config", cfg, "--verify")
    assert done.returncode == 0, done.stderr
    got = safetensors_torch.load_file(tmp_path / "hf" / "model.safetensors")
    expected = fp8_dcp.te_dequantized(scales="per-shard", formats="mixed")
    assert sorted(got) == sorted(expected)
    for name, value in expected.items():
        assert got[name].dtype == torch.bfloat16 and torch.equal(got[name].view(torch.int16), value.view(torch.int16)), name
    reference = transformers.LlamaForCausalLM(fp8_dcp.te_config())  # float32: the bf16 values exactly
    reference.load_state_dict(expected)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32)
    tokens = torch.tensor([[1, 5, 9, 2, 33, 17, 4, 60]])
    with torch.no_grad():
        assert torch.equal(loaded(tokens).logits, reference(tokens).logits)
    same = run_cli("diff", ckpt, tmp_path / "hf")
    assert same.returncode == 0 and "12 tensors: 12 equal, 0 close, 0 differs" in same.stdout, same.stdout + same.stderr


FP8_NAMES = [n for n, v in fp8_dcp.te_full().items() if isinstance(v, tuple)]


def _assert_loaded_exactly(loaded: list[dict], world_size: int, scales: str, formats: str = "e4m3") -> None:
    """Every rank's local shards, as torch's dcp.load put them in the model: the saved codes of
    its rows and the scale_inv saved for them, bit for bit; the bf16 tensors equal."""
    full = fp8_dcp.te_full(formats)
    for rank, shards in enumerate(loaded):
        for name, value in full.items():
            kind, got, scale = shards[name]
            whole = value[0] if isinstance(value, tuple) else value
            per = -(-whole.shape[0] // world_size)
            lo, hi = min(rank * per, whole.shape[0]), min((rank + 1) * per, whole.shape[0])
            want = whole[lo:hi]
            if isinstance(value, tuple):
                assert kind == "Float8StandIn" and torch.equal(got, want), (rank, name)
                saved = fp8_dcp.te_shard_scale(name, lo, scales, formats)
                assert scale.view(torch.int32).equal(saved.view(torch.int32)), (rank, name)
            else:
                assert kind == "Tensor" and torch.equal(got.view(torch.int16), want.view(torch.int16)), (rank, name)


def test_reshard_keeps_te_float8_items(te_shared, tmp_path):
    """TE's FSDP2 shards share one scale_inv: resharded 2 → 3 ranks (a rank's rows from both saved
    shards), every item is TE's Float8Tensor pickle again, in the source's form, and torch's own
    dcp.load into Float8Tensor (stand-in) shards at 3 ranks gives the saved codes and scale_inv."""
    out = tmp_path / "ws3"
    done = run_cli("reshard", te_shared, out, "--world-size", "3", "--verify")
    assert done.returncode == 0, done.stderr
    assert done.stderr.rstrip().endswith(", verified")
    _assert_loaded_exactly(fp8_dcp.load_te(str(out), 3), 3, "shared")
    spec = load_tensor_record_spec(_item_pickle(out, "model.model.layers.0.mlp.up_proj.weight", rank=1))
    assert type(spec) is Float8RecordSpec
    assert (spec.fp8.name, spec.dtype.name, spec.size, spec.dtype_module, spec.args) == (
        "float8_e4m3fn", "bfloat16", (11, 16), "transformer_engine.pytorch.constants", 6)


def test_te_float8_target_chunk_takes_the_scale_its_rows_share():
    """The scale a target chunk's item gets: its source rows' one scale, none when they hold two;
    an empty chunk (FSDP2's past the last row) the scale of the row before it."""
    from ckptctl.core.dtypes import DTYPES
    from ckptctl.core.geometry import Box
    from ckptctl.formats.dcp.te_float8 import Float8Rows, TeFloat8Target
    from ckptctl.util.errors import CheckpointError

    a, b = b"\x00\x00\x80\x3b", b"\x00\x00\x00\x3c"  # 2^-8 and 2^-7, float32 little-endian
    target = TeFloat8Target("w", DTYPES["bfloat16"], DTYPES["float8_e4m3fn"], "transformer_engine_torch", 5,
                            (Float8Rows(0, 8, a), Float8Rows(8, 16, b), Float8Rows(16, 16, a)))
    assert [target.scale_of(Box((lo, 0), (n, 4))) for lo, n in ((0, 8), (2, 3), (8, 8), (16, 0), (0, 0))] == [a, a, b, b, a]
    with pytest.raises(CheckpointError, match=r"^w: rows \[6, 10\) join transformer_engine Float8Tensor items of "
                                              r"2 different scale_inv \(0\.00390625, 0\.0078125\): "):
        target.scale_of(Box((6, 0), (4, 4)))


def test_reshard_refuses_joining_te_float8_shards_of_different_scales(te_ckpt, tmp_path):
    ckpt = te_ckpt[0]
    done = run_cli("reshard", ckpt, tmp_path / "out", "--world-size", "1")
    assert done.returncode == 2
    assert done.stderr.splitlines()[-1] == (
        "ckptctl: error: model.model.layers.0.self_attn.q_proj.weight: rows [0, 16) join transformer_engine "
        "Float8Tensor items of 2 different scale_inv (0.00244140625, 0.0048828125): TE's FSDP2 shards share one "
        "scale, and keeping FP8 codes exactly needs one; reshard to a world size whose chunks keep within its saved "
        "shards, or export-hf it (dequantized)")
    assert not (tmp_path / "out").exists()


@pytest.mark.full
def test_reshard_refuses_casting_te_float8(te_shared, tmp_path):
    done = run_cli("reshard", te_shared, tmp_path / "out", "--world-size", "1", "--dtype", "float32")
    assert done.returncode == 2
    assert done.stderr.splitlines()[-1] == (
        "ckptctl: error: --dtype float32: model.model.layers.0.self_attn.q_proj.weight is a transformer_engine "
        "Float8Tensor, whose FP8 codes reshard keeps as they are (export-hf dequantizes it)")


@pytest.mark.full
def test_verify_refuses_te_float8_items_of_other_scales(te_ckpt, te_shared, tmp_path):
    """--verify's Float8Tensor check decodes both sides by torch's loader: the same codes under
    another scale_inv (the per-shard save's output checked against the shared one) fail it."""
    from ckptctl.checks.float8_output import verify_float8
    from ckptctl.commands.reshard import ReshardOptions, plan_reshard
    from ckptctl.formats.dcp.items import ItemReader
    from ckptctl.formats.dcp.metadata import open_checkpoint
    from ckptctl.util.errors import CheckpointError

    out = tmp_path / "ws4"
    assert run_cli("reshard", te_ckpt[0], out, "--world-size", "4").returncode == 0
    fqn, dst = "model.model.layers.0.mlp.down_proj.weight", open_checkpoint(out)
    for source, fails in ((te_ckpt[0], False), (te_shared, True)):
        src = open_checkpoint(source)
        target = plan_reshard(src, ReshardOptions(world_size=4)).targets[fqn]
        with ItemReader(src) as src_items, ItemReader(dst) as dst_items:
            if not fails:
                verify_float8(src, src_items, dst, dst_items, target, out)
                continue
            with pytest.raises(CheckpointError, match=r"rows \[8, 12\) of the item at \[8, 0\], decoded by torch, "
                                                      r"are not the codes and scale_inv of the source's item at \[8, 0\]"):
                verify_float8(src, src_items, dst, dst_items, target, out)


def test_export_torch_writes_te_float8_as_its_values(te_ckpt, tmp_path):
    """torch.load(weights_only=True), export-torch's reader, cannot build TE's class without TE:
    the file holds each Float8Tensor's values as TE dequantizes them, and says which."""
    out = tmp_path / "model.pt"
    done = run_cli("export-torch", te_ckpt[0], out, "--verify", "--json")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["dequantized_fp8"] == [f"model.{n}" for n in FP8_NAMES]
    got = torch.load(out, weights_only=True)["model"]
    expected = fp8_dcp.te_dequantized(scales="per-shard", formats="mixed")
    assert sorted(got) == sorted(expected)
    for name, value in expected.items():
        assert got[name].dtype == torch.bfloat16 and torch.equal(got[name].view(torch.int16), value.view(torch.int16))


def test_export_hf_fp8_block_keeps_te_codes_and_scale(te_shared, tmp_path):
    """A per-tensor scale is one scale for every 128×128 block: `--quantize fp8-block` of TE's
    e4m3 weights writes TE's codes bit for bit and its scale_inv in every block (not the
    scale amax / 448 quantizing TE's values again gives: the fixture's codes stop below 448), and
    transformers' FP8 load (dequantizing on CPU) has TE's values and their model's logits."""
    fp8_dcp.te_config().save_pretrained(tmp_path / "cfg")
    out = tmp_path / "hf"
    done = run_cli("export-hf", te_shared, out, "--hf-config", tmp_path / "cfg", "--quantize", "fp8-block", "--verify")
    assert done.returncode == 0, done.stderr
    assert ("note: 7 weights from Transformer Engine Float8Tensor items: a block whose rows share one scale_inv that "
            "codes TE's values exactly keeps that scale and those values (e4m3: TE's codes, bit for bit); any other "
            "is quantized from the values\n") in done.stderr
    got = safetensors_torch.load_file(out / "model.safetensors")
    for name in FP8_NAMES:
        codes, scale, fp8 = fp8_dcp.te_full()[name]
        assert fp8 == got[name].dtype == torch.float8_e4m3fn and torch.equal(got[name].view(torch.uint8), codes), name
        assert got[name + "_scale_inv"].view(torch.int32).equal(scale.view(1, 1).view(torch.int32)), name
    expected = fp8_dcp.te_dequantized()
    loaded = transformers.AutoModelForCausalLM.from_pretrained(
        out, quantization_config=transformers.FineGrainedFP8Config(dequantize=True), dtype=torch.bfloat16)
    reference = transformers.LlamaForCausalLM(fp8_dcp.te_config()).to(torch.bfloat16)
    reference.load_state_dict(expected)
    state = loaded.state_dict()
    for name, value in expected.items():
        assert torch.equal(state[name].view(torch.int16), value.view(torch.int16)), name
    tokens = torch.tensor([[1, 5, 9, 2, 33, 17, 4, 60]])
    with torch.no_grad():
        assert torch.equal(loaded(tokens).logits, reference(tokens).logits)


@pytest.mark.full
def test_export_hf_fp8_block_quantizes_te_blocks_joining_scales_from_their_values(te_ckpt, tmp_path):
    """A block of rows from two shards of different scale_inv has no one scale to keep: it is
    quantized from TE's values (Megatron-Bridge's formula), as any bf16 weight."""
    from tests.formats.quantized_folders import quantized_fp8

    ckpt, cfg = te_ckpt
    done = run_cli("export-hf", ckpt, tmp_path / "hf", "--hf-config", cfg, "--quantize", "fp8-block", "--verify")
    assert done.returncode == 0, done.stderr
    got = safetensors_torch.load_file(tmp_path / "hf" / "model.safetensors")
    values = fp8_dcp.te_dequantized(scales="per-shard", formats="mixed")
    for name in FP8_NAMES:
        codes, scale = quantized_fp8(values[name])
        assert not torch.equal(got[name].view(torch.uint8), fp8_dcp.te_full("mixed")[name][0]), name
        assert torch.equal(got[name].view(torch.uint8), codes.view(torch.uint8)), name
        assert got[name + "_scale_inv"].view(torch.int32).equal(scale.view(torch.int32)), name


@pytest.mark.full
def test_reshard_at_the_saved_size_writes_torch_saves_records(te_shared, tmp_path):
    """At the saved world size every item holds the records torch.save wrote for TE's tensor (the
    stand-in's `__reduce_ex__`): the same `data.pkl`, codes and scale_inv, all but the
    serialization id, which torch draws at random."""
    from torch.distributed.checkpoint import FileSystemReader

    out = tmp_path / "ws2"
    assert run_cli("reshard", te_shared, out, "--world-size", "2").returncode == 0
    for path in (te_shared, out):
        assert len(FileSystemReader(str(path)).read_metadata().storage_data) == 24
    for name in FP8_NAMES:
        for rank in (0, 1):
            records = []
            for path in (te_shared, out):
                md = FileSystemReader(str(path)).read_metadata()
                info = next(v for k, v in md.storage_data.items()
                            if k.fqn == f"model.{name}" and v.relative_path == f"__{rank}_0.distcp")
                item = (path / info.relative_path).read_bytes()[info.offset:info.offset + info.length]
                archive = zipfile.ZipFile(io.BytesIO(item))
                records.append({n.split("/", 1)[1]: archive.read(n) for n in archive.namelist()
                                if not n.endswith("serialization_id")})
            assert records[0] == records[1] and len(records[0]) == 7, (name, rank)


@pytest.mark.full
def test_reshard_keeps_each_shards_own_te_scale(te_ckpt, tmp_path):
    """Shards of their own scales, resharded 2 → 4 ranks (each new chunk inside one saved shard):
    each keeps its shard's scale_inv."""
    out = tmp_path / "ws4"
    done = run_cli("reshard", te_ckpt[0], out, "--world-size", "4", "--verify")
    assert done.returncode == 0, done.stderr
    _assert_loaded_exactly(fp8_dcp.load_te(str(out), 4, "mixed"), 4, "per-shard", "mixed")


@pytest.mark.full
@pytest.mark.parametrize("dtype_module, args", [("transformer_engine_torch", 5), ("transformer_engine_torch", 6),
                                                ("transformer_engine.pytorch.constants", 5)])
def test_te_float8_forms_across_releases(tmp_path, dtype_module, args):
    """TE 2.16–2.17 pickle the pybind `transformer_engine_torch.DType`, later the Python IntEnum;
    the sixth reduce argument (data_transpose) is in TE's current source only."""
    fp8_dcp.save_te(str(tmp_path / "ckpt"), dtype_module=dtype_module, args=args)
    fp8_dcp.te_config().save_pretrained(tmp_path / "cfg")
    done = run_cli("export-hf", tmp_path / "ckpt", tmp_path / "hf", "--hf-config", tmp_path / "cfg", "--verify")
    assert done.returncode == 0, done.stderr
    got = safetensors_torch.load_file(tmp_path / "hf" / "model.safetensors")
    for name, value in fp8_dcp.te_dequantized().items():
        assert torch.equal(got[name].view(torch.int16), value.view(torch.int16)), name
    done = run_cli("reshard", tmp_path / "ckpt", tmp_path / "ws1", "--world-size", "1", "--verify")
    assert done.returncode == 0, done.stderr
    spec = load_tensor_record_spec(_item_pickle(tmp_path / "ws1", "model.model.layers.0.self_attn.o_proj.weight"))
    assert (spec.dtype_module, spec.args, spec.size) == (dtype_module, args, (16, 16))
    _assert_loaded_exactly(fp8_dcp.load_te(str(tmp_path / "ws1"), 1), 1, "shared")


def test_torchao_item_decodes_to_its_plain_tensor(torchao_ckpt):
    spec = load_tensor_record_spec(_item_pickle(torchao_ckpt, "model.0.weight"))
    assert type(spec) is WrappedRecordSpec and spec.cast.name == "float8_e4m3fn"
    assert (spec.inner.dtype.name, spec.inner.size, spec.inner.stride) == ("bfloat16", (32, 32), (32, 1))


def test_inspect_shows_torchao_wrapper(torchao_ckpt):
    shown = run_cli("inspect", torchao_ckpt)
    assert shown.returncode == 0, shown.stderr
    assert f"Subclasses        2 tensors: {TORCHAO}\n" in shown.stdout
    doc = json.loads(run_cli("inspect", torchao_ckpt, "--json").stdout)
    assert doc["subclasses"] == {"model.0.weight": TORCHAO, "model.1.weight": TORCHAO}


@pytest.mark.parametrize("world_size", [3, pytest.param(1, marks=pytest.mark.full)])
def test_reshard_keeps_torchao_weights_exactly(torchao_saved, tmp_path, world_size):
    """The resharded checkpoint loads with torch's dcp.load into the same torchao-converted,
    fully_shard'ed model (its weights still torchao's wrappers) with the saved values, bit for bit."""
    torchao_ckpt, saved = torchao_saved
    out = tmp_path / f"ws{world_size}"
    done = run_cli("reshard", torchao_ckpt, out, "--world-size", str(world_size), "--verify")
    assert done.returncode == 0, done.stderr
    loaded = fp8_dcp.load_torchao(str(out))
    assert {k: kind for k, (kind, _) in loaded.items()} == {
        "0.weight": "WeightWithDynamicFloat8CastTensor", "1.weight": "WeightWithDynamicFloat8CastTensor",
        "1.bias": "Tensor"}
    assert sorted(saved) == sorted(loaded)
    for name, value in saved.items():
        assert torch.equal(loaded[name][1].view(torch.int16), value.view(torch.int16)), name


TORCHAO_MOE = "torchao.prototype.moe_training.tensor.Float8TrainingWeightWrapperTensor (casts to float8_e4m3fn)"


@pytest.fixture(scope="module")
def torchao_moe_saved(tmp_path_factory) -> tuple[Path, dict[str, torch.Tensor]]:
    if not fp8_dcp.torchao_available():
        pytest.skip("torchao not installed (make oracles puts it beside the venv)")
    path = tmp_path_factory.mktemp("torchao_moe") / "ckpt"
    kinds, saved = fp8_dcp.save_torchao(str(path), recipe="moe")
    assert kinds == ["0.weight:Float8TrainingWeightWrapperTensor", "1.bias:Float8TrainingWeightWrapperTensor",
                     "1.weight:Float8TrainingWeightWrapperTensor"]
    return path, saved


@pytest.mark.full
def test_torchao_moe_wrapper_is_shown_and_resharded_exactly(torchao_moe_saved, tmp_path):
    """torchao's MoE training wrapper holds the bf16 weight as WeightWithDynamicFloat8CastTensor
    does: inspect names it, its item decodes to that tensor, and the resharded checkpoint loads with
    torch's dcp.load into the same converted, fully_shard'ed model (still wrapped) bit for bit —
    which torch cannot do with the original (torchao allow-lists no class of it for `weights_only`)."""
    ckpt, saved = torchao_moe_saved
    shown = run_cli("inspect", ckpt)
    assert shown.returncode == 0 and f"Subclasses        3 tensors: {TORCHAO_MOE}\n" in shown.stdout, shown.stderr
    spec = load_tensor_record_spec(_item_pickle(ckpt, "model.1.bias", rank=1))
    assert type(spec) is WrappedRecordSpec and (spec.inner.dtype.name, spec.inner.size) == ("bfloat16", (8,))
    with pytest.raises(RankError, match="Unsupported global: GLOBAL torchao.prototype.moe_training.tensor."
                                        "Float8TrainingWeightWrapperTensor"):
        fp8_dcp.load_torchao(str(ckpt), recipe="moe")
    done = run_cli("reshard", ckpt, tmp_path / "out", "--world-size", "3", "--verify")
    assert done.returncode == 0, done.stderr
    loaded = fp8_dcp.load_torchao(str(tmp_path / "out"), recipe="moe")
    assert {k: kind for k, (kind, _) in loaded.items()} == dict.fromkeys(saved, "Float8TrainingWeightWrapperTensor")
    for name, value in saved.items():
        assert torch.equal(loaded[name][1].view(torch.int16), value.view(torch.int16)), name


@pytest.mark.full
def test_mutated_torchao_moe_items_end_in_refusals_only(torchao_moe_saved):
    from ckptctl.formats.pickle.unpickle import TensorRecordSpec

    assert refused_mutants(_item_pickle(torchao_moe_saved[0], "model.0.weight"),
                           (TensorRecordSpec, WrappedRecordSpec)) > 500


@pytest.mark.full
def test_resharded_torchao_loads_without_torchao(torchao_saved, tmp_path):
    """torch's dcp.load of torchao's save needs torchao imported (its classes are allow-listed for
    `weights_only` on import); the reshard's plain tensors load into the model without it."""
    torchao_ckpt, saved = torchao_saved
    assert fp8_dcp.load_plain(str(torchao_ckpt)) == "CheckpointException"
    done = run_cli("reshard", torchao_ckpt, tmp_path / "out", "--world-size", "2")
    assert done.returncode == 0, done.stderr
    loaded = fp8_dcp.load_plain(str(tmp_path / "out"))
    assert sorted(loaded) == sorted(saved)
    for name, value in saved.items():
        assert torch.equal(loaded[name].view(torch.int16), value.view(torch.int16)), name


def _mutations(pickled: bytes):
    """Each opcode of a real pickle dropped, doubled, and each GLOBAL swapped for every other
    global the pickle names: the small exhaustive neighbourhood of a real item."""
    import pickletools

    ops = list(pickletools.genops(pickled))
    ends = [pos for _, _, pos in ops[1:]] + [len(pickled)]
    globals_ = sorted({arg for op, arg, _ in ops if op.name == "GLOBAL"})
    for (op, arg, start), end in zip(ops, ends):
        yield pickled[:start] + pickled[end:]
        yield pickled[:end] + pickled[start:]
        if op.name == "GLOBAL":
            for other in globals_:
                if other != arg:
                    yield pickled[:start] + b"c" + other.replace(" ", "\n").encode() + b"\n" + pickled[end:]


def refused_mutants(pickled: bytes, decoded_as: tuple[type, ...]) -> int:
    """How many of `_mutations(pickled)` the decoder refuses, each in one short line; every other
    one decodes to a spec of one of the `decoded_as` types, never anything else."""
    from ckptctl.formats.pickle.unpickle import MalformedPickleError

    refused = 0
    for mutated in _mutations(pickled):
        try:
            spec = load_tensor_record_spec(mutated)
        except (MalformedPickleError, UnsafePickleError) as exc:
            assert "\n" not in str(exc) and len(str(exc)) < 400
            refused += 1
        else:
            assert type(spec) in decoded_as
    return refused


@pytest.mark.parametrize("which", ["te", "torchao"])
def test_mutated_subclass_items_end_in_refusals_only(which, request):
    """No neighbour of a real subclass item escapes the decoder with anything but its refusals."""
    from ckptctl.formats.pickle.unpickle import TensorRecordSpec

    if which == "te":
        pickled = _item_pickle(request.getfixturevalue("te_ckpt")[0], "model.model.layers.0.mlp.up_proj.weight")
    else:
        pickled = _item_pickle(request.getfixturevalue("torchao_ckpt"), "model.1.weight")
    assert refused_mutants(pickled, (TensorRecordSpec, WrappedRecordSpec, Float8RecordSpec)) > 100
