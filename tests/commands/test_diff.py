"""`ckptctl diff` as a user runs it: real checkpoints of other layouts, one changed value, exact verdicts.

The inputs are written by the real CLI (a reshard of the 4-rank FSDP2 fixture to 3 ranks,
its raw Hugging Face export in float32 and in bfloat16, `import-hf --to torchtitan` and
`--to megatron-fsdp` of a tiny Llama folder transformers saved) and then changed in place at
the byte the metadata points to, or are safetensors folders written by
`safetensors.torch.save_file` with known values, so every max |a-b| and first index below
is exact. Inputs are made once per module.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from tests.conftest import ROOT, run_cli
from tests.terminal import assert_no_traceback, run_in_terminal

CHANGED = "optim.state.mlp.fc1.weight.exp_avg"  # [12, 8] float32; element [7, 3] gets +DELTA
INDEX = (7, 3)
DELTA = 0.001
PIPE_EQUAL = "32 tensors: 32 equal, 0 close, 0 differs; 13 bytes entries: 13 equal, 0 differs\n"


@dataclass
class Made:
    src: Path
    resharded: Path
    hf: Path
    changed: Path
    old: float  # the changed element in the source
    new: float  # and in `changed`
    partial: Path
    flat: Path
    flat_resharded: Path
    st_a: Path
    st_b: Path
    bytes_changed: Path
    bytes_length: int
    hf_bf16: Path


def _element_offset(ckpt_dir: Path, fqn: str, index: tuple[int, ...]) -> tuple[Path, int]:
    """File and byte offset of one element of a saved tensor, from `.metadata` and the item's zip."""
    from ckptctl.formats.dcp.items import ItemReader
    from ckptctl.formats.dcp.metadata import open_checkpoint

    ckpt = open_checkpoint(ckpt_dir)
    entry = ckpt.tensors[fqn]
    chunk = next(c for c in entry.chunks if all(o <= i < o + s for i, o, s in zip(index, c.offsets, c.sizes)))
    with ItemReader(ckpt) as reader:
        record = reader.locate(entry, chunk)
    local = (index[0] - chunk.offsets[0]) * chunk.sizes[1] + (index[1] - chunk.offsets[1])
    return record.path, record.byte_offset + local * entry.itemsize


def _safetensors_inputs(root: Path) -> tuple[Path, Path]:
    """Two folders with known differences: A one file, B two shards and an index."""
    big = torch.arange(4200 * 1024, dtype=torch.float32).reshape(4200, 1024)  # 17.2 MB: two 16 MB blocks
    a = {
        "big": big,
        "nan_same": torch.tensor([1.0, float("nan"), 3.0]),
        "signed_zero": torch.tensor([0.0, 1.0]),
        "nan_one_side": torch.tensor([1.0, 2.0]),
        "ints": torch.arange(5, dtype=torch.int64),
        "half": torch.ones(4, 4, dtype=torch.bfloat16),
        "scalar": torch.tensor(1.0),
        "shape": torch.zeros(2, 3),
        "dtype": torch.zeros(3),
        "only_a": torch.zeros(1),
    }
    b = {k: v.clone() for k, v in a.items() if k != "only_a"}
    b["big"][4100, 5] += 0.5  # second block: the first difference
    b["big"][4150, 0] -= 3.0  # the largest
    b["signed_zero"][0] = -0.0
    b["nan_one_side"][1] = float("nan")
    b["ints"][3] = 100
    b["half"][2, 1] = 1.5
    b["scalar"] = torch.tensor(1.25)
    b["shape"] = torch.zeros(3, 2)
    b["dtype"] = torch.zeros(3, dtype=torch.float16)
    b["only_b"] = torch.zeros(1)
    st_a, st_b = root / "st_a", root / "st_b"
    st_a.mkdir()
    st_b.mkdir()
    save_file(a, str(st_a / "model.safetensors"), metadata={"format": "pt"})
    shards = {"model-00001-of-00002.safetensors": ["big", "ints"],
              "model-00002-of-00002.safetensors": [k for k in b if k not in ("big", "ints")]}
    for file, names in shards.items():
        save_file({k: b[k] for k in names}, str(st_b / file), metadata={"format": "pt"})
    weight_map = {name: file for file, names in shards.items() for name in names}
    (st_b / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return st_a, st_b


@pytest.fixture(scope="module")
def made(fixture_ckpt, tmp_path_factory) -> Made:
    root = tmp_path_factory.mktemp("diff")
    src, flat = fixture_ckpt("fsdp2_4ranks"), fixture_ckpt("flat_optim")
    (root / "config.json").write_text('{"model_type": "raw"}')
    runs = [("reshard", src, root / "r3", "-n", "3"),
            ("reshard", src, root / "partial", "-n", "2", "--exclude", "optim.state.head.*"),
            ("reshard", flat, root / "flat2", "-n", "2"),
            ("export-hf", src, root / "hf", "--hf-config", root / "config.json", "--arch", "raw", "--no-name-check"),
            ("export-hf", src, root / "hf_bf16", "--hf-config", root / "config.json", "--arch", "raw",
             "--no-name-check", "--dtype", "bf16")]
    for args in runs:
        res = run_cli(*args)
        assert res.returncode == 0, res.stderr
    changed = root / "changed"
    shutil.copytree(root / "r3", changed)
    path, offset = _element_offset(changed, CHANGED, INDEX)
    with open(path, "r+b") as fh:
        fh.seek(offset)
        (old,) = struct.unpack("<f", fh.read(4))
        (new,) = struct.unpack("<f", struct.pack("<f", old + DELTA))
        fh.seek(offset)
        fh.write(struct.pack("<f", new))
    bytes_changed = root / "bytes_changed"
    shutil.copytree(root / "r3", bytes_changed)
    from ckptctl.formats.dcp.metadata import open_checkpoint

    entry = open_checkpoint(bytes_changed).bytes_entries["extra.iteration"]
    with open(bytes_changed / entry.file, "r+b") as fh:  # the item's last byte (its zip's end record)
        fh.seek(entry.offset + entry.length - 1)
        last = fh.read(1)
        fh.seek(-1, 1)
        fh.write(bytes([last[0] ^ 0xFF]))
    st_a, st_b = _safetensors_inputs(root)
    return Made(src, root / "r3", root / "hf", changed, old, new, root / "partial", flat, root / "flat2",
                st_a, st_b, bytes_changed, entry.length, root / "hf_bf16")


def diff_json(*args: object) -> tuple[int, dict]:
    """Run `ckptctl diff ARGS --json`: exit status and the document (stdout is pure JSON, stderr empty)."""
    res = run_cli("diff", *args, "--json")
    assert res.stderr == ""
    return res.returncode, json.loads(res.stdout)


def diff_doc(a: Path, b: Path, **options: object) -> tuple[int, dict]:
    """The same document and exit status, computed in this process: a CLI run that compares
    differing values pays a torch import (seconds), so most checks of values run here."""
    from ckptctl.cli.diff_cmd import report_json
    from ckptctl.commands.diff import diff

    report = diff(a, b, **options)
    return (0 if report.equal else 1), json.loads(json.dumps(report_json(report), allow_nan=False))


def test_a_reshard_to_3_ranks_is_equal_to_its_4_rank_source(made):
    res = run_cli("diff", made.src, made.resharded)
    assert (res.returncode, res.stdout, res.stderr) == (0, PIPE_EQUAL, "")
    code, doc = diff_json(made.resharded, made.src)
    assert code == 0 and doc["equal"] is True
    assert doc["counts"] == {"equal": 32, "close": 0, "differs": 0, "shape differs": 0, "dtype differs": 0,
                             "missing in A": 0, "missing in B": 0}
    assert doc["bytes_counts"] == {"equal": 13, "differs": 0, "missing in A": 0, "missing in B": 0}
    assert doc["formats"] == {"a": "dcp", "b": "dcp"} and doc["stripped_prefixes"] == {"a": None, "b": None}
    assert doc["mapped_by"] == {"a": None, "b": None} and doc["compare_as"] is None
    assert doc["tensors"]["model.embed.weight"] == {
        "status": "equal", "shape": [10, 8], "dtype": "float32", "max_abs_diff": 0.0, "first_diff_index": None,
        "mismatches": 0, "compared_as": None, "a": {"name": "model.embed.weight", "shape": [10, 8], "dtype": "float32"},
        "b": {"name": "model.embed.weight", "shape": [10, 8], "dtype": "float32"}}
    assert doc["bytes_entries"]["extra.iteration"]["status"] == "equal"
    assert doc["bytes_compared"] > 0 and (doc["atol"], doc["rtol"]) == (0.0, 0.0)


def test_flat_optimizer_buffers_compare_in_their_params_shape(made):
    """Megatron-FSDP flat 1-D states equal their rebuilt N-D reshard: compared in the param's shape."""
    code, doc = diff_json(made.flat, made.flat_resharded)
    assert code == 0 and doc["counts"]["equal"] == 16
    state = doc["tensors"]["optimizer.state.module.output_layer.weight.exp_avg"]
    assert state["shape"] == doc["tensors"]["model.module.output_layer.weight"]["shape"]
    assert len(state["shape"]) == 2 and state["status"] == "equal"


def test_zstd_items_compare_equal_to_plain_ones(made, fixture_ckpt):
    """Same values saved at 2 ranks with zstd-compressed items (tensors and bytes entries alike)."""
    from ckptctl.commands.diff import diff

    report = diff(made.src, fixture_ckpt("zstd"))
    assert report.equal and report.counts["equal"] == 32 and report.bytes_counts["equal"] == 13


def test_dcp_against_its_hf_export_compares_model_tensors_without_the_prefix(made):
    names = ["embed.weight", "head.bias", "head.weight", "mlp.fc1.bias", "mlp.fc1.weight", "mlp.fc2.bias",
             "mlp.fc2.weight", "norm.weight"]
    for a, b, prefixes in ((made.src, made.hf, {"a": "model.", "b": None}),
                           (made.hf, made.resharded, {"a": None, "b": "model."})):
        code, doc = diff_json(a, b)
        assert code == 0 and list(doc["tensors"]) == names
        assert doc["stripped_prefixes"] == prefixes and doc["bytes_entries"] == {}
        dcp_side = "a" if prefixes["a"] else "b"
        assert doc["tensors"]["mlp.fc1.weight"][dcp_side]["name"] == "model.mlp.fc1.weight"
        assert doc["notes"] == [f"{a if dcp_side == 'a' else b}: model tensors only, prefix 'model.' stripped; "
                                "37 optimizer and other entries left out (only model weights are in a "
                                "safetensors folder)"]
    res = run_cli("diff", made.src, made.hf)
    assert res.returncode == 0
    assert res.stdout == "8 tensors: 8 equal, 0 close, 0 differs\n"
    assert res.stderr == (f"note: {made.src}: model tensors only, prefix 'model.' stripped; 37 optimizer and other "
                          "entries left out (only model weights are in a safetensors folder)\n")


def test_one_changed_element_differs_with_its_exact_max_and_index(made):
    code, doc = diff_json(made.changed, made.src)
    assert code == 1 and doc["equal"] is False
    assert doc["counts"]["differs"] == 1 and doc["counts"]["equal"] == 31
    assert doc["tensors"][CHANGED] == {
        "status": "differs", "shape": [12, 8], "dtype": "float32", "max_abs_diff": abs(made.new - made.old),
        "first_diff_index": list(INDEX), "mismatches": 1, "compared_as": None,
        "a": {"name": CHANGED, "shape": [12, 8], "dtype": "float32"},
        "b": {"name": CHANGED, "shape": [12, 8], "dtype": "float32"}}
    assert made.new != made.old


def test_pipe_output_is_plain_lines_and_the_summary(made):
    res = run_cli("diff", made.changed, made.src)
    assert res.returncode == 1 and res.stderr == ""
    assert "\x1b" not in res.stdout
    assert res.stdout == (f"{CHANGED}: differs: first at [7, 3], max |a-b| {abs(made.new - made.old):.6g}, "
                          "1 of 96 elements\n"
                          "32 tensors: 31 equal, 0 close, 1 differs; 13 bytes entries: 13 equal, 0 differs\n")


def test_tolerance_makes_a_small_change_close(made):
    delta = abs(made.new - made.old)
    for options in ({"atol": 0.01}, {"rtol": delta / abs(made.old) * 1.01}):
        code, doc = diff_doc(made.changed, made.src, **options)
        assert code == 0 and doc["equal"] is True
        assert doc["counts"]["close"] == 1 and doc["counts"]["equal"] == 31
        got = doc["tensors"][CHANGED]
        assert (got["status"], got["max_abs_diff"], got["first_diff_index"], got["mismatches"]) == \
            ("close", delta, None, 0)
    code, doc = diff_doc(made.changed, made.src, atol=delta / 2)  # too tight
    assert code == 1 and doc["tensors"][CHANGED]["status"] == "differs"
    code, doc = diff_json(made.changed, made.src, "--atol", "0.01", "--rtol", "0")
    assert code == 0 and (doc["atol"], doc["rtol"]) == (0.01, 0.0) and doc["counts"]["close"] == 1


def test_missing_tensors_on_one_side(made):
    code, doc = diff_doc(made.src, made.partial)
    assert code == 1
    gone = ["optim.state.head.bias.exp_avg", "optim.state.head.bias.exp_avg_sq", "optim.state.head.bias.step",
            "optim.state.head.weight.exp_avg", "optim.state.head.weight.exp_avg_sq", "optim.state.head.weight.step"]
    assert [n for n, t in doc["tensors"].items() if t["status"] != "equal"] == gone
    assert doc["tensors"][gone[0]] == {
        "status": "missing in B", "shape": None, "dtype": None, "max_abs_diff": None, "first_diff_index": None,
        "mismatches": None, "compared_as": None, "a": {"name": gone[0], "shape": [2], "dtype": "float32"}, "b": None}
    res = run_cli("diff", made.partial, made.src)
    assert res.returncode == 1
    lines = res.stdout.splitlines()
    assert lines[0] == "optim.state.head.bias.exp_avg: missing in A: B: [2] float32"
    assert lines[-1] == "26 tensors: 26 equal, 0 close, 0 differs; 13 bytes entries: 13 equal, 0 differs; 6 only in B"


def test_a_changed_bytes_entry_differs_at_its_first_byte(made):
    code, doc = diff_doc(made.bytes_changed, made.src)
    assert code == 1 and doc["counts"]["equal"] == 32
    assert doc["bytes_counts"] == {"equal": 12, "differs": 1, "missing in A": 0, "missing in B": 0}
    length = made.bytes_length
    assert doc["bytes_entries"]["extra.iteration"] == {
        "status": "differs", "first_diff_index": [length - 1],
        "a": {"name": "extra.iteration", "nbytes": length}, "b": {"name": "extra.iteration", "nbytes": length}}


SAFETENSORS_SUMMARY = ("9 tensors: 1 equal, 1 close, 5 differs, 1 shape differs, 1 dtype differs; "
                       "1 only in A; 1 only in B")


def test_safetensors_folders_with_known_differences(made):
    code, doc = diff_doc(made.st_a, made.st_b)
    assert code == 1 and doc["formats"] == {"a": "safetensors", "b": "safetensors"}
    got = {n: (t["status"], t["max_abs_diff"], t["first_diff_index"], t["mismatches"])
           for n, t in doc["tensors"].items()}
    assert got == {
        "big": ("differs", 3.0, [4100, 5], 2),  # the first difference is in the second 16 MB block
        "dtype": ("dtype differs", None, None, None),
        "half": ("differs", 0.5, [2, 1], 1),
        "ints": ("differs", 97.0, [3], 1),
        "nan_one_side": ("differs", "nan", [1], 1),
        "nan_same": ("equal", 0.0, None, 0),
        "only_a": ("missing in B", None, None, None),
        "only_b": ("missing in A", None, None, None),
        "scalar": ("differs", 0.25, [], 1),
        "shape": ("shape differs", None, None, None),
        "signed_zero": ("close", 0.0, None, 0),  # -0.0 == 0.0, though the bytes differ
    }
    assert doc["tensors"]["dtype"]["a"] == {"name": "dtype", "shape": [3], "dtype": "float32"}
    assert doc["tensors"]["dtype"]["b"] == {"name": "dtype", "shape": [3], "dtype": "float16"}
    assert doc["tensors"]["shape"]["shape"] is None and doc["tensors"]["shape"]["b"]["shape"] == [3, 2]
    res = run_cli("diff", made.st_a, made.st_b)
    assert res.returncode == 1 and res.stdout.splitlines() == [
        "big: differs: first at [4100, 5], max |a-b| 3, 2 of 4300800 elements",
        "dtype: dtype differs: A float32, B float16",
        "half: differs: first at [2, 1], max |a-b| 0.5, 1 of 16 elements",
        "ints: differs: first at [3], max |a-b| 97, 1 of 5 elements",
        "nan_one_side: differs: first at [1], max |a-b| nan, 1 of 2 elements",
        "only_a: missing in B: A: [1] float32",
        "only_b: missing in A: B: [1] float32",
        "scalar: differs: first at [], max |a-b| 0.25, 1 of 1 elements",
        "shape: shape differs: A [2, 3], B [3, 2]",
        "signed_zero: close: max |a-b| 0",
        SAFETENSORS_SUMMARY,
    ]


def test_a_wide_tolerance_leaves_only_one_sided_nan_and_layout_differences(made):
    code, doc = diff_doc(made.st_a, made.st_b, atol=1000, include=["*"], exclude=["only_*"])
    statuses = {n: t["status"] for n, t in doc["tensors"].items()}
    assert code == 1 and statuses == {"big": "close", "dtype": "dtype differs", "half": "close", "ints": "close",
                                      "nan_one_side": "differs", "nan_same": "equal", "scalar": "close",
                                      "shape": "shape differs", "signed_zero": "close"}
    code, doc = diff_doc(made.st_a, made.st_b, atol=1000, include=["big", "i*"])
    assert code == 0 and list(doc["tensors"]) == ["big", "ints"] and doc["counts"]["close"] == 2


def test_a_single_safetensors_file_against_a_folder(made):
    code, doc = diff_json(made.st_a / "model.safetensors", made.st_a)
    assert code == 0 and doc["counts"]["equal"] == 10


def test_filters_that_select_nothing_are_refused_naming_the_patterns(made):
    res = run_cli("diff", made.src, made.hf, "--include", "nothing*", "--exclude", "x")
    assert res.returncode == 2 and res.stdout == ""
    assert res.stderr == (f"ckptctl: error: --include 'nothing*' --exclude 'x' select no tensor or bytes entry "
                          f"of {made.src} or {made.hf}\n")


@pytest.mark.parametrize("case", ["file", "missing", "empty-dir", "bad-safetensors", "negative-atol", "compare-as"])
def test_bad_input_is_one_line_and_exit_2(made, tmp_path, case):
    (tmp_path / "empty").mkdir()
    (tmp_path / "notes.txt").write_text("hello")
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "model.safetensors").write_bytes(b"\xff" * 16)
    args, line = {
        "file": ((tmp_path / "notes.txt", made.src), f"{tmp_path / 'notes.txt'}: not a directory (diff takes DCP "
                                                     "checkpoints, safetensors model folders or .safetensors files)"),
        "missing": ((made.src, tmp_path / "nope"), f"{tmp_path / 'nope'}: no such file or directory"),
        "empty-dir": ((tmp_path / "empty", made.src), f"{tmp_path / 'empty'}: neither a DCP checkpoint (no .metadata) "
                                                       "nor a safetensors model folder (no *.safetensors)"),
        "bad-safetensors": ((made.hf, tmp_path / "bad"), f"{tmp_path / 'bad' / 'model.safetensors'}: not a "
                                                          "safetensors file (no header of a plausible length)"),
        "negative-atol": ((made.src, made.src, "--atol", "-1"), "--atol must be a finite number >= 0 (got -1.0)"),
        "compare-as": ((made.src, made.hf_bf16, "--compare-as", "int8"),
                       "--compare-as must be one of bf16, fp16, fp32, bfloat16, float16, float32 (got 'int8')"),
    }[case]
    res = run_cli("diff", *args)
    assert (res.returncode, res.stdout, res.stderr) == (2, "", f"ckptctl: error: {line}\n")
    assert_no_traceback(res.stderr)


def test_a_terminal_shows_the_table_the_bar_and_the_summary(made):
    run = run_in_terminal("diff", made.st_a, made.st_b)
    assert run.returncode == 1
    assert_no_traceback(run.screen)
    screen = run.screen
    assert "comparing" in screen  # the progress bar stays, at its total
    rows = [line for line in screen.splitlines() if line.startswith("│")]
    assert any("big" in r and "differs" in r and "first at [4100, 5], max |a-b| 3, 2 of 4300800 elements" in r
               for r in rows)
    assert any("signed_zero" in r and "close" in r for r in rows)
    assert screen.splitlines()[-1] == SAFETENSORS_SUMMARY
    assert "\x1b[" in run.raw  # colour on a terminal


def test_an_equal_compare_never_imports_torch(made):
    code = ("import runpy, sys; sys.argv = ['ckptctl', 'diff', *sys.argv[1:]]\n"
            "try:\n    runpy.run_module('ckptctl', run_name='__main__')\n"
            "except SystemExit as exc:\n    print('exit', exc.code, 'torch' in sys.modules)")
    for extra in ([], ["--compare-as", "bf16"]):  # one dtype, the same bytes: equal in bf16 too, nothing cast
        res = subprocess.run([sys.executable, "-c", code, str(made.src), str(made.resharded), *extra],
                             capture_output=True, text=True, cwd=ROOT, timeout=120)
        assert res.stdout.splitlines()[-1] == "exit 0 False"


def test_a_tensor_with_coverage_gaps_is_refused_unless_filtered_out(made, tmp_path):
    import pickle

    gaps = tmp_path / "gaps"
    shutil.copytree(made.resharded, gaps)
    metadata = pickle.loads((gaps / ".metadata").read_bytes())  # torch's own classes: torch is imported here
    del metadata.state_dict_metadata["model.mlp.fc1.weight"].chunks[-1]  # rank 2's rows 8..11
    (gaps / ".metadata").write_bytes(pickle.dumps(metadata))
    res = run_cli("diff", gaps, made.src)
    assert (res.returncode, res.stdout) == (2, "")
    assert res.stderr == (f"ckptctl: error: {gaps}: model.mlp.fc1.weight: chunks cover 64 of 96 elements "
                          "(32 missing): cannot compare elements that were never saved\n")
    code, doc = diff_doc(gaps, made.hf, exclude=["mlp.fc1.weight"])
    assert code == 0 and doc["counts"]["equal"] == 7


# --------------------------------------------------------------------------------------
# Across dtypes (--compare-as) and across naming schemes (the family tables)
# --------------------------------------------------------------------------------------

MODEL_NOTE = ("note: {src}: model tensors only, prefix 'model.' stripped; 37 optimizer and other entries left out "
              "(only model weights are in a safetensors folder)\n")
RAW_NAMES = ["embed.weight", "head.bias", "head.weight", "mlp.fc1.bias", "mlp.fc1.weight", "mlp.fc2.bias",
             "mlp.fc2.weight", "norm.weight"]


def _changed_copy(folder: Path, out: Path, name: str, change) -> tuple[Path, torch.Tensor, torch.Tensor]:
    """A copy of a one-file safetensors folder with `change(tensor)` applied to tensor `name` in place;
    the tensor before and after."""
    from safetensors.torch import load_file

    shutil.copytree(folder, out)
    state = load_file(folder / "model.safetensors")
    before = state[name].clone()
    change(state[name])
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out, before, state[name]


def test_an_fp32_checkpoint_against_its_bf16_export_says_how_to_compare_values(made):
    res = run_cli("diff", made.src, made.hf_bf16)
    assert res.returncode == 1
    assert res.stdout.splitlines() == [f"{n}: dtype differs: A float32, B bfloat16" for n in RAW_NAMES] + [
        "8 tensors: 0 equal, 0 close, 0 differs, 8 dtype differs"]
    assert res.stderr == MODEL_NOTE.format(src=made.src) + (
        "note: 8 floating-point tensors differ in dtype only: --compare-as bf16 compares their values as bfloat16\n")


def test_compared_as_bf16_an_fp32_checkpoint_equals_its_exact_bf16_export(made):
    res = run_cli("diff", made.src, made.hf_bf16, "--compare-as", "bf16")
    assert (res.returncode, res.stdout) == (0, "8 tensors: 8 equal, 0 close, 0 differs\n")
    assert res.stderr == MODEL_NOTE.format(src=made.src) + (
        "note: values compared as bfloat16: A's 8 float32 tensors cast to it, rounding to nearest even (as export-hf "
        "--dtype casts)\n")
    code, doc = diff_json(made.hf_bf16, made.src, "--compare-as", "bfloat16")
    assert code == 0 and doc["compare_as"] == "bfloat16" and doc["counts"]["equal"] == 8
    assert doc["tensors"]["mlp.fc1.weight"] == {
        "status": "equal", "shape": [12, 8], "dtype": None, "max_abs_diff": 0.0, "first_diff_index": None,
        "mismatches": 0, "compared_as": "bfloat16",
        "a": {"name": "mlp.fc1.weight", "shape": [12, 8], "dtype": "bfloat16"},
        "b": {"name": "model.mlp.fc1.weight", "shape": [12, 8], "dtype": "float32"}}
    assert doc["notes"][1] == ("values compared as bfloat16: B's 8 float32 tensors cast to it, rounding to nearest "
                               "even (as export-hf --dtype casts)")


def test_compared_as_fp32_the_bf16_rounding_differs_everywhere_it_rounded(made):
    from safetensors.torch import load_file

    code, doc = diff_doc(made.src, made.hf_bf16, compare_as="fp32")
    exported = load_file(made.hf_bf16 / "model.safetensors")["embed.weight"].double()
    source = load_file(made.hf / "model.safetensors")["embed.weight"].double()  # the source's values (equal above)
    rounded = exported != source
    first = tuple(int(i) for i in rounded.nonzero()[0])
    got = doc["tensors"]["embed.weight"]
    assert code == 1 and got["status"] == "differs" and got["compared_as"] == "float32"
    assert (got["first_diff_index"], got["mismatches"], got["max_abs_diff"]) == \
        (list(first), int(rounded.sum()), float((exported - source).abs().max()))


def test_compared_as_bf16_the_first_element_off_the_exact_cast_is_reported(made, tmp_path):
    def next_bf16(t: torch.Tensor) -> None:
        t.view(torch.int16)[3, 5] += 1  # the next bfloat16 value away from zero

    changed, before, after = _changed_copy(made.hf_bf16, tmp_path / "changed", "mlp.fc1.weight", next_bf16)
    delta = abs(float(after[3, 5]) - float(before[3, 5]))
    code, doc = diff_doc(made.src, changed, compare_as="bf16")
    assert code == 1 and doc["counts"] == {"equal": 7, "close": 0, "differs": 1, "shape differs": 0,
                                           "dtype differs": 0, "missing in A": 0, "missing in B": 0}
    got = doc["tensors"]["mlp.fc1.weight"]
    assert (got["status"], got["first_diff_index"], got["mismatches"], got["max_abs_diff"]) == \
        ("differs", [3, 5], 1, delta)
    res = run_cli("diff", made.src, changed, "--compare-as", "bf16")
    assert res.stdout.splitlines() == [
        f"mlp.fc1.weight: differs: first at [3, 5], max |a-b| {delta:.6g}, 1 of 96 elements (as bfloat16)",
        "8 tensors: 7 equal, 0 close, 1 differs"]
    code, doc = diff_doc(made.src, changed, compare_as="bf16", atol=delta)
    assert code == 0 and doc["tensors"]["mlp.fc1.weight"]["status"] == "close"


def test_a_reshard_compared_as_bf16_is_equal_without_a_cast(made):
    """Same dtype, same bytes: equal in any dtype, and never cast (no torch needed for it)."""
    code, doc = diff_doc(made.src, made.resharded, compare_as="bf16")
    assert code == 0 and doc["counts"]["equal"] == 32 and doc["bytes_counts"]["equal"] == 13


@dataclass
class Mapped:
    hf: Path
    """A tiny Llama folder (2 layers, hidden 8) that transformers saved."""
    titan: Path
    """`import-hf --to torchtitan` of it."""
    hf_kv2: Path
    """The same with two key-value heads, so that Megatron can split it over TP 2."""
    megatron: Path
    """`import-hf --to megatron-fsdp --tp 2` of that: fused linear_qkv and TP-blocked fused linear_fc1."""
    hf_dcp: Path
    """`import-hf` (FSDP2) of the first: its Hugging Face names behind the prefix `model.`."""
    moe: Path
    """A tiny Qwen3-MoE folder (2 layers of 4 experts) that transformers saved."""
    moe_titan: Path
    """`import-hf --to torchtitan` of it: experts stacked [E, F, D], a zero expert bias per layer."""


@pytest.fixture(scope="module")
def mapped(tmp_path_factory) -> Mapped:
    import transformers

    from tests.conftest import tiny_llama_folder

    root = tmp_path_factory.mktemp("diff-mapped")
    hf = tiny_llama_folder(root / "hf", layers=2)
    torch.manual_seed(1)
    config = transformers.LlamaConfig(vocab_size=32, hidden_size=8, intermediate_size=16, num_hidden_layers=2,
                                      num_attention_heads=2, num_key_value_heads=2)
    transformers.LlamaForCausalLM(config).save_pretrained(root / "hf_kv2")
    moe = transformers.Qwen3MoeConfig(vocab_size=32, hidden_size=8, intermediate_size=16, moe_intermediate_size=4,
                                      num_experts=4, num_experts_per_tok=2, num_hidden_layers=2, num_attention_heads=2,
                                      num_key_value_heads=1, head_dim=4)
    transformers.Qwen3MoeForCausalLM(moe).save_pretrained(root / "moe")
    for args in (("import-hf", hf, root / "titan", "--to", "torchtitan", "--world-size", "2"),
                 ("import-hf", root / "hf_kv2", root / "megatron", "--to", "megatron-fsdp", "--tp", "2", "--dp", "1"),
                 ("import-hf", hf, root / "hf_dcp", "--world-size", "2"),
                 ("import-hf", root / "moe", root / "moe_titan", "--to", "torchtitan", "--world-size", "2")):
        res = run_cli(*args)
        assert res.returncode == 0, res.stderr
    return Mapped(hf, root / "titan", root / "hf_kv2", root / "megatron", root / "hf_dcp", root / "moe",
                  root / "moe_titan")


def test_a_torchtitan_import_equals_its_hf_source_through_the_family_tables(mapped):
    res = run_cli("diff", mapped.titan, mapped.hf)
    assert (res.returncode, res.stdout) == (0, "21 tensors: 21 equal, 0 close, 0 differs\n")
    assert res.stderr == (f"note: {mapped.titan}: 21 model tensors mapped to 21 Hugging Face tensors by export-hf's "
                          f"torchtitan-llama3 rules ({mapped.hf / 'config.json'})\n")
    code, doc = diff_json(mapped.hf, mapped.titan)
    assert code == 0 and doc["mapped_by"] == {"a": None, "b": "torchtitan-llama3"}
    assert doc["tensors"]["model.layers.0.self_attn.q_proj.weight"] == {  # RoPE rows reordered, as export-hf does
        "status": "equal", "shape": [8, 8], "dtype": "float32", "max_abs_diff": 0.0, "first_diff_index": None,
        "mismatches": 0, "compared_as": None,
        "a": {"name": "model.layers.0.self_attn.q_proj.weight", "shape": [8, 8], "dtype": "float32"},
        "b": {"name": "layers.0.attention.qkv_linear.wq.weight", "shape": [8, 8], "dtype": "float32"}}
    assert doc["tensors"]["model.embed_tokens.weight"]["b"]["name"] == "tok_embeddings.weight"


def test_a_changed_element_of_a_rope_reordered_tensor_is_found_at_its_hf_index(mapped, tmp_path):
    def bump(t: torch.Tensor) -> None:
        t[5, 3] += 0.5

    name = "model.layers.1.self_attn.q_proj.weight"  # [8, 8]: torchtitan holds its rows in another order
    changed, before, after = _changed_copy(mapped.hf, tmp_path / "hf", name, bump)
    delta = abs(float(after[5, 3]) - float(before[5, 3]))
    code, doc = diff_doc(mapped.titan, changed)
    assert code == 1 and doc["counts"]["equal"] == 20 and doc["counts"]["differs"] == 1
    got = doc["tensors"][name]
    assert (got["status"], got["first_diff_index"], got["mismatches"], got["max_abs_diff"]) == \
        ("differs", [5, 3], 1, delta)
    res = run_cli("diff", changed, mapped.titan)
    assert res.returncode == 1 and res.stdout.splitlines() == [
        f"{name}: differs: first at [5, 3], max |a-b| {delta:.6g}, 1 of 64 elements",
        "21 tensors: 20 equal, 0 close, 1 differs"]


def test_megatron_fused_tensors_are_compared_by_the_views_export_hf_cuts(mapped, tmp_path):
    """linear_qkv is q, k and v of each query group; linear_fc1 at TP 2 is [gate_0; up_0; gate_1; up_1]."""
    code, doc = diff_json(mapped.megatron, mapped.hf_kv2)
    assert code == 0 and doc["counts"]["equal"] == 21 and doc["mapped_by"] == {"a": "llama", "b": None}
    assert doc["notes"] == [f"{mapped.megatron}: 15 model tensors mapped to 21 Hugging Face tensors by export-hf's "
                            f"llama rules ({mapped.hf_kv2 / 'config.json'})"]
    layer = "model.module.decoder.layers.0."
    assert {n: doc["tensors"][f"model.layers.0.{n}"]["a"]["name"] for n in (
        "self_attn.q_proj.weight", "self_attn.k_proj.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight")} == {
        "self_attn.q_proj.weight": layer + "self_attention.linear_qkv.weight",
        "self_attn.k_proj.weight": layer + "self_attention.linear_qkv.weight",
        "mlp.gate_proj.weight": layer + "mlp.linear_fc1.weight",
        "mlp.up_proj.weight": layer + "mlp.linear_fc1.weight"}

    def bump(t: torch.Tensor) -> None:
        t[9, 2] -= 2.0

    changed, before, after = _changed_copy(mapped.hf_kv2, tmp_path / "hf", "model.layers.0.mlp.up_proj.weight", bump)
    code, doc = diff_doc(mapped.megatron, changed)
    assert code == 1 and [n for n, t in doc["tensors"].items() if t["status"] != "equal"] == \
        ["model.layers.0.mlp.up_proj.weight"]
    got = doc["tensors"]["model.layers.0.mlp.up_proj.weight"]
    assert (got["first_diff_index"], got["mismatches"], got["max_abs_diff"]) == \
        ([9, 2], 1, abs(float(after[9, 2]) - float(before[9, 2])))


def test_torchtitan_expert_stacks_are_compared_expert_by_expert(mapped, tmp_path):
    res = run_cli("diff", mapped.moe_titan, mapped.moe)
    assert (res.returncode, res.stdout) == (0, "45 tensors: 45 equal, 0 close, 0 differs\n")
    assert res.stderr == (f"note: {mapped.moe_titan}: 27 model tensors mapped to 45 Hugging Face tensors by export-hf's "
                          f"torchtitan-qwen3 rules ({mapped.moe / 'config.json'}); 2 other entries left out\n"
                          "note: 2 torchtitan expert biases (layers.*.moe.expert_bias_E) not exported: all zero, and "
                          "qwen3_moe routes without one\n")

    def bump(t: torch.Tensor) -> None:
        t[6, 2] += 1.0

    name = "model.layers.1.mlp.experts.2.down_proj.weight"  # [8, 4]: slab 2 of layer 1's w2 stack
    changed, before, after = _changed_copy(mapped.moe, tmp_path / "moe", name, bump)
    code, doc = diff_doc(mapped.moe_titan, changed)
    assert code == 1 and [n for n, t in doc["tensors"].items() if t["status"] != "equal"] == [name]
    got = doc["tensors"][name]
    assert (got["first_diff_index"], got["mismatches"], got["max_abs_diff"], got["a"]["name"]) == \
        ([6, 2], 1, abs(float(after[6, 2]) - float(before[6, 2])), "layers.1.moe.routed_experts.inner_experts.w2_EDF")


def test_names_as_saved_with_arch_raw(mapped):
    res = run_cli("diff", mapped.titan, mapped.hf, "--arch", "raw")
    assert res.returncode == 1
    assert res.stdout.splitlines()[-1] == "1 tensor: 1 equal, 0 close, 0 differs; 20 only in A; 20 only in B"


def test_a_config_beside_a_lone_safetensors_file_or_given(mapped, tmp_path):
    lone = tmp_path / "lone"
    lone.mkdir()
    shutil.copy(mapped.hf / "model.safetensors", lone / "model.safetensors")
    res = run_cli("diff", mapped.titan, lone / "model.safetensors")
    assert (res.returncode, res.stdout) == (2, "")
    assert res.stderr == (f"ckptctl: error: {mapped.titan}: its torchtitan names are mapped to Hugging Face ones by "
                          f"export-hf's rules, which need the model's config.json, and {lone} has none: pass "
                          "--hf-config (or --arch raw to compare the names as saved)\n")
    code, doc = diff_json(mapped.titan, lone / "model.safetensors", "--hf-config", mapped.hf / "config.json")
    assert code == 0 and doc["counts"]["equal"] == 21


def test_a_torchtitan_checkpoint_against_an_hf_named_one_with_the_config_given(mapped):
    res = run_cli("diff", mapped.hf_dcp, mapped.titan, "--hf-config", mapped.hf)
    assert (res.returncode, res.stdout) == (0, "21 tensors: 21 equal, 0 close, 0 differs\n")
    assert res.stderr == (f"note: {mapped.hf_dcp}: prefix 'model.' stripped\n"  # nothing else to leave out
                          f"note: {mapped.titan}: 21 model tensors mapped to 21 Hugging Face tensors by export-hf's "
                          f"torchtitan-llama3 rules ({mapped.hf / 'config.json'})\n")
    res = run_cli("diff", mapped.titan, mapped.hf_dcp)  # without a config: every entry under its name, as ever
    assert (res.returncode, res.stderr) == (1, "")
    assert res.stdout.splitlines()[-1] == "0 tensors: 0 equal, 0 close, 0 differs; 21 only in A; 21 only in B"
    res = run_cli("diff", mapped.titan, mapped.hf_dcp, "--arch", "torchtitan-llama3")
    assert (res.returncode, res.stdout) == (2, "")
    assert res.stderr == (f"ckptctl: error: {mapped.titan}: its names are mapped to Hugging Face ones by export-hf's "
                          "rules, which need the model's config.json: pass --hf-config (or --arch raw to compare the "
                          "names as saved)\n")


@pytest.mark.parametrize("case", ["two-hf-named", "two-torchtitan", "config-for-hf-names", "raw-and-config",
                                  "unknown-arch", "wrong-family"])
def test_mapping_options_that_cannot_apply_are_one_line(made, mapped, case):
    args, line = {
        "two-hf-named": ((made.src, made.resharded, "--arch", "llama"),
                         "--arch is for mapping torchtitan or Megatron names to Hugging Face ones, and neither "
                         f"{made.src} nor {made.resharded} has such names"),
        "two-torchtitan": ((mapped.titan, mapped.titan, "--tp", "2"),
                           "--tp is for mapping torchtitan or Megatron names to Hugging Face ones, and both "
                           f"{mapped.titan} and {mapped.titan} have such names"),
        "config-for-hf-names": ((made.src, made.hf, "--hf-config", mapped.hf),
                                "--hf-config is for mapping torchtitan or Megatron names to Hugging Face ones, and "
                                f"{made.src}'s names are neither torchtitan's nor Megatron's"),
        "raw-and-config": ((mapped.titan, mapped.hf, "--arch", "raw", "--hf-config", mapped.hf),
                           "--hf-config is for mapping torchtitan or Megatron names to Hugging Face ones, and --arch "
                           "raw compares the names as saved"),
        "unknown-arch": ((mapped.titan, mapped.hf, "--arch", "gpt9"), "--arch must be one of auto, llama, qwen2, "
                         "qwen3, qwen3-moe, qwen3-next, qwen3.5, deepseek-v3, mixtral, gemma2, gemma3, nemotron-h, "
                         "gpt-oss, torchtitan-llama3, torchtitan-qwen3, torchtitan-deepseek-v3, automodel, raw (got "
                         "'gpt9')"),
        "wrong-family": ((mapped.titan, mapped.hf, "--arch", "llama"),
                         f"{mapped.titan}: no Megatron model tensors (decoder.layers.*, embedding.word_embeddings.*) "
                         "under any prefix of 'model.module.module.', 'model.module.', 'model.', ''; for HF-named "
                         "checkpoints use --arch raw"),
    }[case]
    res = run_cli("diff", *args)
    assert (res.returncode, res.stdout, res.stderr) == (2, "", f"ckptctl: error: {line}\n")


@pytest.mark.parametrize("case", ["layers", "hidden", "fifo"])
def test_a_config_that_does_not_fit_the_checkpoint_is_one_line(mapped, tmp_path, case):
    folder = tmp_path / "hf"
    shutil.copytree(mapped.hf, folder)
    config = json.loads((folder / "config.json").read_text())
    if case == "fifo":
        (folder / "config.json").unlink()
        os.mkfifo(folder / "config.json")
    else:
        config.update({"layers": {"num_hidden_layers": 3}, "hidden": {"hidden_size": 16}}[case])
        (folder / "config.json").write_text(json.dumps(config))
    line = {
        "layers": f"{folder / 'config.json'}: num_hidden_layers=3, but the weights in {mapped.titan} hold at most 2 "
                  "layers (wrong --hf-config?)",
        "hidden": "tok_embeddings.weight: gives model.embed_tokens.weight shape [32, 8] but config.json implies "
                  "[32, 16] (hidden_size=16, intermediate_size=16; wrong --hf-config?)",
        "fifo": f"{folder / 'config.json'}: not a regular file (a FIFO)",
    }[case]
    res = run_cli("diff", mapped.titan, folder, timeout=60)
    assert (res.returncode, res.stdout, res.stderr) == (2, "", f"ckptctl: error: {line}\n")
