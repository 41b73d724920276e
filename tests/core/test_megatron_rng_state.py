"""Megatron-LM's RNG state by its entry names, as `megatron/training/checkpointing.py` saves it.

`get_rng_state` keeps a list of the DP ranks' states per (PP, TP) rank (all DP ranks' with
`--data-parallel-random-init` at DP > 1, else one): torch_dist as the ShardedObject `rng_state`
of global shape (PP, TP) at (pp, tp) (megatron-core's `ShardedObject.unique_key`:
`rng_state/shard_<pp>.<tp>_<PP>.<TP>`), fsdp_dtensor as `{'(pp, tp)': list}`, which DCP flattens
to `rng_state.(<pp>, <tp>).<i>.<field>`. The names and the selection a reshard makes of them;
the real saves and their reshards are in `tests/planners/test_torch_dist_optimizer.py`.
"""

from __future__ import annotations

import pytest

from ckptctl.core.rank_state import megatron_rng, megatron_rng_selection
from ckptctl.util.errors import UsageError

FIELDS = ("random_rng_state", "np_rng_state", "torch_rng_state", "cuda_rng_state",
          "rng_tracker_states.model-parallel-rng")
FSDP = [f"rng_state.(0, {tp}).{dp}.{field}" for tp in (0, 1) for dp in (0, 1) for field in FIELDS]


def test_fsdp_dtensor_rng_state_is_named_by_its_pp_tp_and_dp_ranks() -> None:
    state = megatron_rng([*FSDP, "model.module.decoder.final_layernorm.weight", "args"])
    assert (state.backend, state.grid, state.dp, len(state.fqns)) == ("fsdp_dtensor", ((0, 0), (0, 1)), 2, 20)
    assert state.shown == "rng_state.(pp, tp).{0..1}.* of 2 (PP, TP) ranks"
    assert state.loader == (
        "one state per DP rank of 2 (--data-parallel-random-init): DP rank i resumes state i, at a larger DP ranks "
        "≥ 2 start afresh (partial load; --strict-fsdp-dtensor-load fails); at a (pp, tp) not saved Megatron-LM's "
        "partial load leaves the job's fresh state")
    shared = megatron_rng([f"rng_state.(0, 0).0.{f}" for f in FIELDS])
    assert (shared.dp, shared.per_dp, shared.shown) == (1, False, "rng_state.(0, 0).0.*")
    assert shared.loader.startswith("one state every DP rank resumes: follows any DP size; ")
    assert megatron_rng(["rng_state_0.pth", "rng_state.x", "rng_state.(0, 0)", "extra_state.rng_state.(0, 0).0"]) \
        is None


def test_torch_dist_rng_state_takes_its_dp_states_from_the_args() -> None:
    keys = ["rng_state/shard_0.1_1.2", "rng_state/shard_0.0_1.2", "decoder.final_layernorm.weight"]
    state = megatron_rng(keys, {"data_parallel_random_init": True, "data_parallel_size": 4}.get)
    assert (state.backend, state.fqns, state.grid, state.dp) == (
        "torch_dist", ("rng_state/shard_0.0_1.2", "rng_state/shard_0.1_1.2"), ((0, 0), (0, 1)), 4)
    assert state.loader == (
        "one state per DP rank of 4 (--data-parallel-random-init): DP rank i resumes state i, at a larger DP ranks "
        "≥ 4 fail (IndexError in load_checkpoint); Megatron-LM ignores it at another TP or PP")
    assert megatron_rng(keys, {"data_parallel_random_init": False, "data_parallel_size": 4}.get).dp == 1
    assert megatron_rng(keys, {"data_parallel_random_init": True, "data_parallel_size": 1}.get).dp == 1
    assert megatron_rng(keys).dp is None
    assert megatron_rng(["prefix_rng_state/shard_1.0_2.1"], None).grid == ((1, 0),)  # get_rng_state's key_prefix


def test_a_dp_change_refuses_per_dp_state_unless_dropped_or_cut_to_the_common_ranks() -> None:
    state = megatron_rng(FSDP)
    everything = lambda fqn: True  # noqa: E731
    with pytest.raises(UsageError) as refused:
        megatron_rng_selection(state, everything, 3, False)
    assert str(refused.value) == (
        "rng_state.(pp, tp).{0..1}.* of 2 (PP, TP) ranks: Megatron's RNG state of DP 2 (one state per DP rank, "
        "--data-parallel-random-init) cannot follow a reshard to DP 3 (DP rank i resumes state i); pass --exclude "
        "'rng_state.*' to drop it (every rank starts afresh) or --keep-common-ranks to keep the states of the DP "
        "ranks both sizes have")
    assert megatron_rng_selection(state, everything, 2, False) is everything  # the same DP: kept
    dropped = lambda fqn: not fqn.startswith("rng_state.")  # noqa: E731
    assert megatron_rng_selection(state, dropped, 3, False) is dropped
    one = megatron_rng_selection(state, everything, 1, True)
    assert [f for f in FSDP if one(f)] == [f for f in FSDP if ".0." in f.split(")", 1)[1][:3]]
    assert all(megatron_rng_selection(state, everything, 3, True)(f) for f in FSDP)  # all are common
    shared = megatron_rng(["rng_state.(0, 0).0.torch_rng_state"])
    assert megatron_rng_selection(shared, everything, 8, False) is everything  # follows any DP
    for unkeepable in (shared, None, megatron_rng(["rng_state/shard_0.0_1.1"])):
        with pytest.raises(UsageError, match="^--keep-common-ranks keeps per-rank files of an HF Trainer"):
            megatron_rng_selection(unkeepable, everything, 8, True)


@pytest.mark.full
def test_megatron_cores_torch_dist_rng_state_is_named_and_kept_as_saved(tmp_path) -> None:
    """megatron-core 0.19.2's save of Megatron-LM's RNG state at DP 2 with `--data-parallel-random-init`
    (`fixtures.megatron_rng`): inspect names the ShardedObject and its two DP states from the
    args; a reshard (torch_dist is rewritten at its own layout) keeps it as saved; resumed at DP 1
    rank 0 takes state 0, and at DP 3 megatron-core loads the list of two and Megatron-LM's index
    fails on rank 2, as inspect says."""
    import json

    from fixtures import megatron_optim, megatron_rng
    from tests.conftest import run_cli

    if not megatron_optim.available("0.19"):
        pytest.skip("megatron-core 0.19 is not installed beside")
    src = tmp_path / "src"
    megatron_rng.write(src, 2, True)
    loader = ("one state per DP rank of 2 (--data-parallel-random-init): DP rank i resumes state i, at a larger DP "
              "ranks ≥ 2 fail (IndexError in load_checkpoint); Megatron-LM ignores it at another TP or PP")
    assert json.loads(run_cli("inspect", src, "--json").stdout)["rank_state"] == [
        {"kind": "Megatron's RNG state", "entries": ["rng_state/shard_0.0_1.1"], "dp": 2, "grid": [[0, 0]],
         "loader": loader}]
    assert f"Per-rank state rng_state/shard_0.0_1.1: Megatron's RNG state of (PP, TP) ranks (0, 0), {loader}" in \
        " ".join(run_cli("inspect", src).stdout.split())
    run = run_cli("reshard", src, tmp_path / "out", "--keep-common-ranks")
    assert (run.returncode, run.stderr) == (2, (
        "ckptctl: error: --keep-common-ranks: a torch_dist checkpoint is rewritten at its own layout, its RNG state "
        "as saved, and a conversion between torch_dist and fsdp_dtensor carries none\n"))
    run = run_cli("reshard", src, tmp_path / "out")
    assert run.returncode == 0, run.stderr
    assert run_cli("diff", src, tmp_path / "out").returncode == 0
    assert megatron_rng.load(tmp_path / "out", 2, True) == [0, 1]
    assert megatron_rng.load(tmp_path / "out", 1, True) == [0]
    assert megatron_rng.load(tmp_path / "out", 3, True) == [0, 1, "IndexError: list index out of range"]
    megatron_rng.write(tmp_path / "shared", 2, False)
    assert json.loads(run_cli("inspect", tmp_path / "shared", "--json").stdout)["rank_state"][0]["dp"] == 1
    assert megatron_rng.load(tmp_path / "shared", 3, False) == [0, 0, 0]


def _dcp_with_rng(path, dp: int) -> None:
    """One process's DCP save of a weight beside `get_rng_state`'s fsdp_dtensor value at DP `dp`
    with `--data-parallel-random-init` (DP rank d's state seeded with 1234 + 10·d)."""
    import random
    import warnings

    import torch
    import torch.distributed.checkpoint as dcp

    states = [{"random_rng_state": random.Random(1234 + 10 * d).getstate(),
               "torch_rng_state": torch.Generator().manual_seed(1234 + 10 * d).get_state()} for d in range(dp)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "assuming the intent is to save in a single process"
        dcp.save({"model": {"w": torch.arange(12.0).reshape(4, 3)}, "rng_state": {"(0, 0)": states}},
                 checkpoint_id=str(path), no_dist=True)


def _resumed(path, dp: int) -> list:
    """Megatron-LM's fsdp_dtensor RNG load at DP `dp` (DCP's partial load of `{'(0, 0)': [dp states]}`):
    the seed of each DP rank's resumed state, `fresh` where the checkpoint has none."""
    import random
    import warnings

    import torch
    from torch.distributed.checkpoint import load
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    sd = {"rng_state": {"(0, 0)": [{"random_rng_state": None, "torch_rng_state": torch.zeros(5056, dtype=torch.uint8)}
                                   for _ in range(dp)]}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        load(sd, checkpoint_id=str(path), planner=DefaultLoadPlanner(allow_partial_load=True), no_dist=True)
    seeds = {random.Random(1234 + 10 * d).getstate(): d for d in range(8)}
    return [seeds.get(s["random_rng_state"], "fresh") for s in sd["rng_state"]["(0, 0)"]]


def test_a_plain_reshard_refuses_per_dp_rng_state(tmp_path) -> None:
    """The CLI end to end on a DCP save holding per-DP RNG state: FSDP2 rows are DP ranks, so `-n 3`
    refuses, naming it."""
    from tests.conftest import run_cli

    _dcp_with_rng(tmp_path / "src", 2)
    refused = run_cli("reshard", tmp_path / "src", tmp_path / "ws3", "-n", 3)
    assert (refused.returncode, refused.stderr) == (2, (
        "ckptctl: error: rng_state.(0, 0).{0..1}.*: Megatron's RNG state of DP 2 (one state per DP rank, "
        "--data-parallel-random-init) cannot follow a reshard to DP 3 (DP rank i resumes state i); pass --exclude "
        "'rng_state.*' to drop it (every rank starts afresh) or --keep-common-ranks to keep the states of the DP "
        "ranks both sizes have\n"))
    assert not (tmp_path / "ws3").exists()


@pytest.mark.full
def test_a_plain_reshard_keeps_the_common_ranks_when_asked(tmp_path) -> None:
    """`--keep-common-ranks -n 1` keeps DP rank 0's state, which DCP loads back; at DP 3 the source
    leaves rank 2 its fresh state."""
    from tests.conftest import run_cli

    _dcp_with_rng(tmp_path / "src", 2)
    run = run_cli("reshard", tmp_path / "src", tmp_path / "ws1", "-n", 1, "--keep-common-ranks", "--verify")
    assert run.returncode == 0, run.stderr
    assert _resumed(tmp_path / "ws1", 1) == [0]
    assert _resumed(tmp_path / "src", 3) == [0, 1, "fresh"]


def _megatron_fsdp_with_rng(path, tp: int, dp: int, cp: int = 1) -> None:
    """`_dcp_with_rng` as Megatron-FSDP saves a run of TP `tp` × CP `cp` × DP `dp` with
    `--data-parallel-random-init`: its args, and each TP rank's list of the DP ranks' states."""
    import argparse
    import random
    import warnings

    import torch
    import torch.distributed.checkpoint as dcp

    def states():
        return [{"random_rng_state": random.Random(1234 + 10 * d).getstate(),
                 "torch_rng_state": torch.Generator().manual_seed(1234 + 10 * d).get_state()} for d in range(dp)]

    args = argparse.Namespace(tensor_model_parallel_size=tp, pipeline_model_parallel_size=1, context_parallel_size=cp,
                              data_parallel_size=dp, world_size=tp * cp * dp, data_parallel_random_init=True,
                              ckpt_format="fsdp_dtensor")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"model": {"module.decoder.final_layernorm.weight": torch.arange(8.0)}, "args": args,
                  "rng_state": {f"({0}, {t})": states() for t in range(tp)}}, checkpoint_id=str(path), no_dist=True)


def test_a_plain_reshard_of_a_tensor_parallel_run_counts_dp_ranks_over_its_tp_and_cp(tmp_path) -> None:
    """A plain reshard keeps a Megatron-FSDP checkpoint's TP-blocked tensors as they are, so the job
    that loads it runs at the saved TP (and CP): `-n` ranks are DP = n / (TP × PP × CP). At TP 2 ×
    DP 2 the run's own 4 ranks keep every state (they were refused as "DP 4"); 2 ranks are DP 1;
    8 ranks DP 4; a world size the grid does not divide is refused, naming it. A Megatron-aware
    reshard to FSDP2 rows counts them over the target TP (`--tp`, else the saved one) alike."""
    from tests.conftest import run_cli

    src = tmp_path / "src"
    _megatron_fsdp_with_rng(src, 2, 2)
    run = run_cli("reshard", src, tmp_path / "same", "-n", 4)
    assert run.returncode == 0, run.stderr
    assert run_cli("diff", src, tmp_path / "same").returncode == 0
    run = run_cli("reshard", src, tmp_path / "dp1", "-n", 2, "--keep-common-ranks")
    assert run.returncode == 0, run.stderr
    assert [dp for _, dp in megatron_rng(_names(tmp_path / "dp1")).entry_of] == [0] * 4
    state = "ckptctl: error: rng_state.(pp, tp).{0..1}.* of 2 (PP, TP) ranks: Megatron's RNG state of DP 2"
    dp4 = (" (one state per DP rank, --data-parallel-random-init) cannot follow a reshard to DP 4 (DP rank i resumes "
           "state i); pass --exclude 'rng_state.*' to drop it (every rank starts afresh) or --keep-common-ranks to "
           "keep the states of the DP ranks both sizes have\n")
    for n, line in ((8, dp4), (3, " cannot follow a reshard to 3 ranks, which are no multiple of its 2 (PP, TP) ranks; "
                                  "pass --exclude 'rng_state.*' to drop it (every rank starts afresh)\n")):
        refused = run_cli("reshard", src, tmp_path / f"n{n}", "-n", n)
        assert (refused.returncode, refused.stderr) == (2, state + line)
        assert not (tmp_path / f"n{n}").exists()
    _megatron_fsdp_with_rng(tmp_path / "cp", 2, 2, cp=2)
    run = run_cli("reshard", tmp_path / "cp", tmp_path / "cp8", "-n", 8)
    assert run.returncode == 0, run.stderr
    run = run_cli("reshard", src, tmp_path / "split", "-n", 4, "--split-fused")  # FSDP2 rows, Megatron-aware
    assert run.returncode == 0, run.stderr
    refused = run_cli("reshard", src, tmp_path / "tp1", "-n", 4, "--tp", 1)  # the job at TP 1: DP 4
    assert (refused.returncode, refused.stderr) == (2, state + dp4)


def _names(path) -> list[str]:
    from torch.distributed.checkpoint import FileSystemReader

    return list(FileSystemReader(str(path)).read_metadata().state_dict_metadata)
