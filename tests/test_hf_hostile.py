"""Hostile Hugging Face inputs: one error line, exit 2, in bounded time and memory; no code of theirs ever runs.

A FIFO, a device or a giant sparse file where a config, index or tokenizer file should be;
JSON nested 100,000 deep; safetensors headers listing absurd dims or tensor counts; a
700-byte config claiming 20,000 layers; a config whose `auto_map` names a canary module in
the folder, with "y" waiting on stdin; a Hub that accepts connections and never answers.
Real parts: a folder written by transformers' `save_pretrained`, its DCP import as the
export source, the CLI run as a user runs it.
"""

from __future__ import annotations

import json
import os
import socket
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ckptctl.util.errors import CheckpointError
from ckptctl.storage.hf_files import MAX_JSON_DEPTH, read_json_object
from tests.conftest import FIXTURES, ROOT, run_cli, tiny_llama_folder

pytest.importorskip("transformers")  # the folders are written by its save_pretrained

AUTO_MAP_LINE = "has an auto_map: it names custom model code, and ckptctl never runs code from a model folder"


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    """A two-layer Llama as `save_pretrained` writes it."""
    return tiny_llama_folder(tmp_path_factory.mktemp("hf") / "llama", 2)


@pytest.fixture(scope="module")
def ckpt(folder, tmp_path_factory) -> Path:
    """The folder imported as an FSDP2 DCP checkpoint: the source export-hf reads."""
    from ckptctl.commands.import_hf import ImportOptions, import_hf

    out = tmp_path_factory.mktemp("dcp") / "ckpt"
    import_hf(folder, out, ImportOptions(world_size=1, name_check=False, workers=1, sync=False))
    return out


def copy_of(folder: Path, where: Path, **config_changes) -> Path:
    """The folder's files, copied, with `config_changes` made to its config.json."""
    where.mkdir()
    for path in folder.iterdir():
        (where / path.name).write_bytes(path.read_bytes())
    if config_changes:
        config = json.loads((where / "config.json").read_text())
        (where / "config.json").write_text(json.dumps({**config, **config_changes}))
    return where


def error(res: subprocess.CompletedProcess) -> str:
    assert (res.returncode, res.stdout) == (2, ""), res.stderr
    return res.stderr


def test_a_fifo_config_is_refused_by_import_and_export_without_blocking(folder, ckpt, tmp_path):
    src = copy_of(folder, tmp_path / "hf")
    (src / "config.json").unlink()
    os.mkfifo(src / "config.json")
    line = f"ckptctl: error: {src / 'config.json'}: not a regular file (a FIFO)\n"
    assert error(run_cli("import-hf", src, tmp_path / "dst", "-n", "1", timeout=60)) == line
    assert error(run_cli("export-hf", ckpt, tmp_path / "dst", "--hf-config", src, timeout=60)) == line
    assert error(run_cli("export-hf", ckpt, tmp_path / "dst", "--hf-config", src / "config.json", timeout=60)) == line
    assert not (tmp_path / "dst").exists()


def test_a_device_as_hf_config_is_refused_before_a_byte_is_read(ckpt, tmp_path):
    res = run_cli("export-hf", ckpt, tmp_path / "dst", "--hf-config", "/dev/zero", timeout=60)
    assert error(res) == "ckptctl: error: /dev/zero: not a regular file (a character device)\n"


@pytest.mark.parametrize("name, limit", [("config.json", 4 << 20), ("model.safetensors.index.json", 64 << 20)])
def test_a_giant_sparse_config_or_index_is_refused_by_its_size(folder, tmp_path, name, limit):
    src = copy_of(folder, tmp_path / "hf")
    with open(src / name, "wb") as fh:
        fh.truncate(1 << 30)
    res = run_cli("import-hf", src, tmp_path / "dst", "-n", "1", timeout=60)
    assert error(res) == (f"ckptctl: error: {src / name}: implausibly large (1073741824 bytes; at most {limit} "
                          "are read)\n")


def test_a_fifo_index_is_refused_by_import_and_diff(folder, tmp_path):
    src = copy_of(folder, tmp_path / "hf")
    os.mkfifo(src / "model.safetensors.index.json")
    line = f"ckptctl: error: {src / 'model.safetensors.index.json'}: not a regular file (a FIFO)\n"
    assert error(run_cli("import-hf", src, tmp_path / "dst", "-n", "1", timeout=60)) == line
    assert error(run_cli("diff", src, folder, timeout=60)) == line


def test_a_fifo_tokenizer_file_in_the_reference_is_refused_before_anything_is_written(folder, ckpt, tmp_path):
    ref = copy_of(folder, tmp_path / "ref")
    os.mkfifo(ref / "tokenizer.json")
    res = run_cli("export-hf", ckpt, tmp_path / "dst", "--hf-config", ref, timeout=60)
    assert error(res) == f"ckptctl: error: {ref / 'tokenizer.json'}: not a regular file (a FIFO)\n"
    assert not (tmp_path / "dst").exists()


def test_a_config_nested_100000_deep_is_one_line(ckpt, tmp_path):
    path = tmp_path / "config.json"
    path.write_text("[" * 100_000 + "]" * 100_000)
    res = run_cli("export-hf", ckpt, tmp_path / "dst", "--hf-config", path, timeout=60)
    assert error(res) == f"ckptctl: error: {path}: not a readable JSON config (nested deeper than 64 levels)\n"


def test_json_nesting_is_read_up_to_the_limit_and_refused_past_it(tmp_path):
    path, deepest = tmp_path / "config.json", "[" * (MAX_JSON_DEPTH - 1) + "]" * (MAX_JSON_DEPTH - 1)
    path.write_text('{"a": ' + deepest + "}")
    assert read_json_object(path, "config") == {"a": json.loads(deepest)}
    path.write_text('{"a": [' + deepest + "]}")
    with pytest.raises(CheckpointError, match=r"not a readable JSON config \(nested deeper than 64 levels\)$"):
        read_json_object(path, "config")


def write_safetensors(path: Path, header: bytes, data: bytes) -> Path:
    path.parent.mkdir(parents=True)
    path.write_bytes(struct.pack("<Q", len(header)) + header + data)
    return path


def test_a_header_of_one_tensor_with_300000_dims_is_refused_before_it_is_parsed(tmp_path):
    dims = ",".join(["1"] * 300_000)
    file = write_safetensors(tmp_path / "hf" / "model.safetensors",
                             f'{{"w":{{"dtype":"F32","shape":[{dims}],"data_offsets":[0,4]}}}}'.encode(), bytes(4))
    res = run_cli("import-hf", file.parent, tmp_path / "dst", "-n", "1", "--no-name-check", timeout=60)
    assert error(res) == (f"ckptctl: error: {file}: implausible safetensors header (more than 196608 JSON values "
                          "for 4 bytes of data)\n")


def test_a_header_of_65_dims_is_refused_naming_the_tensor(tmp_path):
    dims = ",".join(["1"] * 65)
    file = write_safetensors(tmp_path / "hf" / "model.safetensors",
                             f'{{"w":{{"dtype":"F32","shape":[{dims}],"data_offsets":[0,4]}}}}'.encode(), bytes(4))
    res = run_cli("import-hf", file.parent, tmp_path / "dst", "-n", "1", "--no-name-check", timeout=60)
    assert error(res) == f"ckptctl: error: {file}: w: 65 dims (a tensor has at most 64)\n"


@pytest.mark.parametrize("count, line", [
    (50_000, "implausible safetensors header (more than 196608 JSON values for 0 bytes of data)"),
    (5_000, "implausible safetensors header (5000 tensors in 0 bytes of data)"),
])
def test_a_header_listing_many_empty_tensors_over_no_data_is_refused(tmp_path, count, line):
    header = {f"t{i}": {"dtype": "F32", "shape": [0], "data_offsets": [0, 0]} for i in range(count)}
    file = write_safetensors(tmp_path / "hf" / "model.safetensors", json.dumps(header).encode(), b"")
    res = run_cli("import-hf", file.parent, tmp_path / "dst", "-n", "1", "--no-name-check", timeout=60)
    assert error(res) == f"ckptctl: error: {file}: {line}\n"


def test_a_config_claiming_20000_layers_is_refused_before_a_model_is_built(folder, ckpt, tmp_path):
    src = copy_of(folder, tmp_path / "hf", num_hidden_layers=20_000)
    config = src / "config.json"
    started = time.monotonic()
    res = run_cli("import-hf", src, tmp_path / "dst", "-n", "1", timeout=120)
    assert error(res) == (f"ckptctl: error: {config}: num_hidden_layers=20000, but the weights in {src} hold at most "
                          "2 layers (is config.json this model's?)\n")
    for arch in ("raw", "auto"):
        res = run_cli("export-hf", ckpt, tmp_path / "dst", "--hf-config", src, "--arch", arch, timeout=120)
        assert error(res) == (f"ckptctl: error: {config}: num_hidden_layers=20000, but the weights in {ckpt} hold "
                              "at most 2 layers (wrong --hf-config?)\n")
    assert time.monotonic() - started < 60  # three runs; building the model took 60 s for one
    assert not (tmp_path / "dst").exists()


def run_with_stdin(*args: str | Path, env: dict[str, str]) -> subprocess.CompletedProcess:
    """The CLI as `run_cli` runs it, with "y" answering any prompt on stdin and `env` added."""
    return subprocess.run([sys.executable, "-m", "ckptctl", *map(str, args)], input="y\n", capture_output=True,
                          text=True, timeout=120, cwd=ROOT, env={**os.environ, **env})


def test_an_auto_map_config_is_refused_and_its_canary_module_never_imported(folder, ckpt, tmp_path):
    src = copy_of(folder, tmp_path / "hf", model_type="canary", architectures=["CanaryModel"],
                  auto_map={"AutoConfig": "canary.CanaryConfig", "AutoModelForCausalLM": "canary.CanaryModel"})
    marker = tmp_path / "IMPORTED"
    (src / "canary.py").write_text(
        f"open({str(marker)!r}, 'w').close()\n"
        "from transformers import LlamaConfig, LlamaForCausalLM\n"
        "class CanaryConfig(LlamaConfig):\n    model_type = 'canary'\n"
        "class CanaryModel(LlamaForCausalLM):\n    config_class = CanaryConfig\n")
    trusting = subprocess.run([sys.executable, "-c", "import sys, transformers; transformers.AutoConfig."
                               "from_pretrained(sys.argv[1], trust_remote_code=True)", str(src)],
                              capture_output=True, text=True, timeout=120, env={**os.environ,
                                                                                "HF_HOME": str(tmp_path / "trusting")})
    assert trusting.returncode == 0 and marker.exists(), trusting.stderr  # the canary is live: trusted, it runs
    marker.unlink()
    home = tmp_path / "hf-home"
    line = f"ckptctl: error: {src / 'config.json'}: {AUTO_MAP_LINE}\n"
    for args in (("import-hf", src, tmp_path / "dst", "-n", "1"),
                 ("export-hf", ckpt, tmp_path / "dst", "--hf-config", src),
                 ("export-hf", ckpt, tmp_path / "dst", "--hf-config", src / "config.json")):
        for json_out in ((), ("--json",)):
            res = run_with_stdin(*args, *json_out, env={"HF_HOME": str(home)})
            assert (res.returncode, res.stdout, res.stderr) == (2, "", line)
    assert not marker.exists()
    assert not (home / "modules").exists()
    assert not (tmp_path / "dst").exists()


@pytest.mark.parametrize("command", ["export-hf", "reshard"])
def test_a_hub_that_accepts_and_never_answers_is_given_up_at_the_deadline(ckpt, tmp_path, command):
    src, options = (ckpt, ()) if command == "export-hf" else (FIXTURES / "megatron_tp2_dp2", ("--split-fused", "-n", "2"))
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(16)  # the kernel completes each connection; nobody ever reads or answers
        endpoint = f"http://127.0.0.1:{server.getsockname()[1]}"
        env = {"HF_HOME": str(tmp_path / "hf-home"), "HF_ENDPOINT": endpoint, "HF_HUB_OFFLINE": "0"}
        started = time.monotonic()
        res = run_with_stdin(command, src, tmp_path / "dst", *options, "--hf-config", "no-such-org/no-such-model",
                             "--hub-timeout", "1.5", env=env)
        elapsed = time.monotonic() - started
    assert error(res) == (
        f"ckptctl: error: --hf-config no-such-org/no-such-model: not a local path, and not in the Hugging Face cache "
        f"({tmp_path / 'hf-home' / 'hub'}), and the Hugging Face Hub ({endpoint}) did not send it within 1.5 s "
        "(connecting and reading; --hub-timeout sets the wait); pass a local folder (or its config.json)\n")
    assert 1.5 <= elapsed < 15, elapsed
