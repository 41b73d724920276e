"""The wide matrix (`-m full`): sources at TP 1/2/4 (flat or N-D states, with or without args) to every layout.

Each source is saved by real gloo ranks in the Megatron-FSDP layout; every output is
compared with the components re-blocked for its TP by torch's own loader, its chunks with
the Megatron-FSDP rule, and one output per source is loaded with `dcp.load` at its new
world size.
"""

from __future__ import annotations

import json
import math
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import torch

from fixtures import megatron_components as mc
from tests.conftest import run_cli
from tests.planners.test_megatron_reshard import assert_values, chunks_by_file, item_ranges, param_of, torch_load

pytestmark = pytest.mark.full

# name: (tp, dp, flat states, args entry)
SOURCES = {"tp1": (1, 3, True, True), "tp2_geometry": (2, 2, False, False), "tp4": (4, 2, True, True)}
# name: (layout args, target tp, megatron-fsdp (tp, dp) or None, flat)
TARGETS = {
    "fsdp2": (("--world-size", "3", "--tp", "2"), 2, None, False),
    "m1x2_flat": (("--layout", "megatron-fsdp", "--tp", "1", "--dp", "2", "--flat-optimizer"), 1, (1, 2), True),
    "m2x3": (("--layout", "megatron-fsdp", "--tp", "2", "--dp", "3"), 2, (2, 3), False),
    "m4x1_flat": (("--layout", "megatron-fsdp", "--tp", "4", "--world-size", "4", "--flat-optimizer"), 4, (4, 1), True),
}


@pytest.fixture(scope="session")
def matrix(tmp_path_factory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("megatron_full")
    (root / "hf").mkdir()
    (root / "hf" / "config.json").write_text(json.dumps(mc.hf_config()))
    for name, (tp, dp, flat, args) in SOURCES.items():
        mc.save_megatron(root / name, tp=tp, dp=dp, flat_states=flat, with_args=args)
    jobs = []
    for source, (_, _, _, args) in SOURCES.items():
        dims = () if args else ("--hf-config", str(root / "hf"))
        for target, (extra, *_) in TARGETS.items():
            jobs.append((f"{source}-{target}", root / source, ("--verify", *extra, *dims)))
        jobs.append((f"{source}-split", root / source, ("--split-fused", "--world-size", "2", *dims)))

    def run(job):
        name, src, args = job
        return name, run_cli("reshard", src, root / name, *args)

    with ThreadPoolExecutor(max_workers=3) as pool:
        results = dict(pool.map(run, jobs))
        second = [(f"{s}-fuse", root / f"{s}-split", ("--fuse", "--tp", "4", "--world-size", "2", "--verify"))
                  for s in SOURCES]
        results.update(pool.map(run, second))
    return {"root": root, "results": results}


def output(matrix: dict[str, Any], name: str) -> Path:
    result = matrix["results"][name]
    assert result.returncode == 0, result.stderr
    return matrix["root"] / name


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("source", SOURCES)
def test_every_source_tp_reaches_every_layout_with_the_values_of_its_target_tp(matrix, source, target):
    _, target_tp, grid, flat = TARGETS[target]
    path = output(matrix, f"{source}-{target}")
    assert_values(torch_load(path), mc.reference(target_tp))
    if grid is None:
        return
    md, chunks = chunks_by_file(path)
    shapes = {param_of(f): tuple(m.size) for f, m in md.items() if f.startswith("model.")}
    for fqn, files in chunks.items():
        if not fqn.startswith(("model.", "optimizer.state.")):
            continue
        size = tuple(md[fqn].size)
        shape = shapes[param_of(fqn)] if size else ()
        boxes = mc.expected_boxes(param_of(fqn), shape, *grid)
        if flat and size != shape:
            expected = {f"__{r}_0.distcp": {((s,), (n,)) for b in bs for s, n in item_ranges(b, shape)}
                        for r, bs in boxes.items()}
            assert size == (math.prod(shape),)
        else:
            expected = {f"__{r}_0.distcp": set(bs) for r, bs in boxes.items()}
        assert files == expected, fqn


@pytest.mark.parametrize("source", SOURCES)
def test_split_then_fuse_for_another_tp_equals_that_tp(matrix, source):
    assert_values(torch_load(output(matrix, f"{source}-split")), mc.split_reference())
    assert_values(torch_load(output(matrix, f"{source}-fuse")), mc.reference(4))


@pytest.mark.parametrize("source", SOURCES)
def test_megatron_fsdp_outputs_load_with_dcp_load_at_their_world_size(matrix, source):
    ref = mc.reference(2)
    for pieces in mc.load_megatron(output(matrix, f"{source}-m2x3"), tp=2, dp=3):
        for fqn, boxes in pieces.items():
            which = "model" if fqn.startswith("model.") else fqn.rsplit(".", 1)[1]
            if which == "step":
                continue
            for offsets, values in boxes:
                want = ref[which][param_of(fqn)]
                for d, (o, s) in enumerate(zip(offsets, values.shape)):
                    want = want.narrow(d, o, s)
                assert torch.equal(values, want), fqn
