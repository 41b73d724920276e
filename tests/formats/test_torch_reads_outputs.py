"""Outputs torch reads back as their sources: the regressions of default runs that exited 0
over wrong or unloadable checkpoints, each from a real save.

1. `.metadata` written at many ranks pointed entries into the wrong rank file: the streaming
   pickle writer memoized file names by `id()` without holding them, so a later name allocated
   where an earlier one had been freed was written as a fetch of the earlier one.
2. A DCP checkpoint of torch's `SerializationFormat.SAFETENSORS` writer records every tensor of
   a file at one storage offset (its blob's start); the copy path knew a chunk by (file,
   offset) alone and read every tensor of the file as the first one.
"""

from __future__ import annotations

import gc
import pickle
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.filesystem import SerializationFormat

from ckptctl.formats.dcp import metadata_out
from ckptctl.formats.pickle import torch_pickle
from ckptctl.formats.dcp.classes import (Metadata, MetadataIndex, StorageInfo, StorageMeta, TensorProperties,
                                          TensorStorageMetadata, ChunkStorageMetadata, size)
from ckptctl.formats.dcp.metadata_out import StreamedDict
from ckptctl.core.dtypes import DTYPES
from tests.conftest import run_cli


def _torch_save(path: Path, state_dict: dict, **writer: object) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(state_dict, storage_writer=FileSystemWriter(path, **writer), no_dist=True)


def _torch_load(path: Path, like: dict) -> dict:
    """`like`'s tensors (zeroed) and values, filled by torch's own reader from `path`."""
    out = {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else None for k, v in like.items()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(out, storage_reader=FileSystemReader(path), no_dist=True)
    return out


def _assert_same(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    for key, value in want.items():
        if isinstance(value, torch.Tensor):
            assert got[key].dtype == value.dtype and torch.equal(got[key], value), key
        else:
            assert got[key] == value, key


# -- 1. many ranks -------------------------------------------------------------------------------


def test_file_names_made_per_entry_pickle_as_torch_pickle_writes_them() -> None:
    """Each storage entry's file name a fresh string, freed once pickled: the emitter must write
    what `torch_pickle` (which holds every memoized object) writes for the same entries."""
    def storage():
        for i in range(3000):
            yield MetadataIndex("w", size((i, 0)), i), StorageInfo(f"__{i % 97}_0.distcp", 64 * i, 64)

    gc.collect()
    md = Metadata(state_dict_metadata={"w": TensorStorageMetadata(TensorProperties(dtype=DTYPES["float32"]),
                                                                   size((3000, 16)), [ChunkStorageMetadata(
                                                                       size((0, 0)), size((3000, 16)))])},
                  planner_data=None, storage_data=StreamedDict(storage, 3000),
                  storage_meta=StorageMeta(checkpoint_id=None, save_id=None, modules=[]), version="1.0.0")
    written = metadata_out.dumps(md)
    assert written == torch_pickle.dumps(metadata_out.materialized(md), protocol=4)
    loaded = pickle.loads(written)  # torch's own classes
    assert [info.relative_path for info in loaded.storage_data.values()] == [f"__{i % 97}_0.distcp"
                                                                             for i in range(3000)]


DEMO_SHAPES = {  # the `make demo` llama: vocab 96, hidden 32, ffn 56, 2 layers, 4 heads, 2 KV heads
    "embed_tokens.weight": (96, 32), "lm_head.weight": (96, 32), "norm.weight": (32,),
    **{f"layers.{i}.{name}": shape for i in range(2) for name, shape in {
        "self_attn.q_proj.weight": (32, 32), "self_attn.k_proj.weight": (16, 32),
        "self_attn.v_proj.weight": (16, 32), "self_attn.o_proj.weight": (32, 32),
        "mlp.gate_proj.weight": (56, 32), "mlp.up_proj.weight": (56, 32), "mlp.down_proj.weight": (32, 56),
        "input_layernorm.weight": (32,), "post_attention_layernorm.weight": (32,)}.items()},
}


@pytest.fixture(scope="session")
def demo_shaped(tmp_path_factory) -> tuple[Path, dict]:
    """A model and its AdamW state in the demo's shapes, saved by torch's own writer."""
    gen = torch.Generator().manual_seed(34)
    sd: dict = {}
    for name, shape in DEMO_SHAPES.items():
        sd[f"model.{name}"] = torch.randn(shape, generator=gen)
        sd[f"optim.state.{name}.exp_avg"] = torch.randn(shape, generator=gen)
        sd[f"optim.state.{name}.exp_avg_sq"] = torch.rand(shape, generator=gen)
        sd[f"optim.state.{name}.step"] = torch.tensor(7.0)
    sd["optim.param_groups.0.lr"] = 0.001
    path = tmp_path_factory.mktemp("demo_shaped") / "ckpt"
    _torch_save(path, sd)
    return path, sd


@pytest.mark.parametrize("ranks", [56, 57, 100, 128, 256])
def test_reshard_at_many_ranks_reads_back_in_torch_as_the_source(demo_shaped, tmp_path: Path, ranks: int) -> None:
    src, sd = demo_shaped
    dst = tmp_path / "out"
    result = run_cli("reshard", src, dst, "-n", ranks, "--no-sync")
    assert result.returncode == 0, result.stderr
    _assert_same(_torch_load(dst, sd), sd)
    holders = max(-(-rows // -(-rows // ranks)) for rows, *_ in DEMO_SHAPES.values())  # FSDP2: ceil(rows / N) each
    assert len(list(dst.glob("*.distcp"))) == holders


def test_reshard_at_many_ranks_writes_the_same_bytes_every_run(demo_shaped, tmp_path: Path) -> None:
    src, _ = demo_shaped
    runs = []
    for k in range(3):
        dst = tmp_path / f"out{k}"
        assert run_cli("reshard", src, dst, "-n", 100, "--no-sync").returncode == 0
        runs.append({p.name: p.read_bytes() for p in sorted(dst.iterdir())})
    assert runs[0] == runs[1] == runs[2]


# -- 2. torch's SAFETENSORS serialization format ----------------------------------------------------


@pytest.fixture(scope="session")
def safetensors_format(tmp_path_factory) -> tuple[Path, dict]:
    """A 2-layer MLP, its Adam state and a step, saved by torch's SAFETENSORS-format writer:
    several tensors to each file's blob, on one thread and on two."""
    gen = torch.Generator().manual_seed(2)
    sd = {"model.0.weight": torch.randn(16, 8, generator=gen), "model.0.bias": torch.randn(16, generator=gen),
          "model.2.weight": torch.randn(4, 16, generator=gen).to(torch.bfloat16),
          "model.2.bias": torch.randn(4, generator=gen),
          "optim.state.model.0.weight.exp_avg": torch.randn(16, 8, generator=gen),
          "optim.state.model.0.weight.step": torch.tensor(3.0), "epoch": 4}
    path = tmp_path_factory.mktemp("st_format") / "ckpt"
    _torch_save(path, sd, serialization_format=SerializationFormat.SAFETENSORS, thread_count=2)
    return path, sd


@pytest.mark.parametrize("ranks", [1, 3])
def test_reshard_of_torchs_safetensors_format_reads_back_as_the_source(safetensors_format, tmp_path: Path,
                                                                       ranks: int) -> None:
    src, sd = safetensors_format
    result = run_cli("reshard", src, tmp_path / "out", "-n", ranks, "--no-sync")
    assert result.returncode == 0, result.stderr
    _assert_same(_torch_load(tmp_path / "out", sd), sd)


def test_export_torch_of_torchs_safetensors_format_loads_as_the_source(safetensors_format, tmp_path: Path) -> None:
    src, sd = safetensors_format
    result = run_cli("export-torch", src, tmp_path / "out.pt", "--no-sync")
    assert result.returncode == 0, result.stderr
    _assert_same(torch.load(tmp_path / "out.pt", weights_only=True), sd)  # saved flat, exported flat


def test_export_hf_of_torchs_safetensors_format_holds_the_sources_weights(safetensors_format, tmp_path: Path) -> None:
    src, sd = safetensors_format
    config = tmp_path / "config.json"
    config.write_text('{"model_type": "mlp"}')  # no transformers model: its names are not checked
    result = run_cli("export-hf", src, tmp_path / "hf", "--hf-config", config, "--arch", "raw", "--no-name-check",
                     "--no-sync")
    assert result.returncode == 0, result.stderr
    exported = load_file(tmp_path / "hf" / "model.safetensors")
    assert sorted(exported) == ["0.bias", "0.weight", "2.bias", "2.weight"]
    for name, tensor in exported.items():
        assert torch.equal(tensor, sd[f"model.{name}"]), name
