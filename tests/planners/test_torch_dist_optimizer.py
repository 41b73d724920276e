"""Megatron-Core torch_dist checkpoints with DistributedOptimizer (Adam) state, saved by
megatron-core itself (`fixtures.megatron_optim`: one training step at TP 2 × DP 2 on CPU, the
same state saved as `dp_reshardable` and `fully_reshardable`; by megatron-core 0.19.2, the
current release, which keeps the common state in a `common_state` item, and under `make
test-full` by the venv's 0.16.1 too, which keeps it in `common.pt`).

inspect names the optimizer format and labels its buckets. reshard lays `dp_reshardable`'s DP
buckets back out in model space: the bucket layout it rebuilds is megatron-core's own
(`param_index_map`, recorded by the fixture), the rebuilt `param` states are the weights, and
megatron-core's own `dist_checkpointing.load` of the output at another TP resumes training with
the loss the saved run had, bit for bit. With several buckets (the default run) that is the
only oracle: megatron-core 0.16.1's own `fully_reshardable` save of such a state is wrong
(fixture docstring); with one bucket (`make test-full`) the output equals that save tensor by
tensor. Skipped without megatron-core (0.19.2 and 0.15.3 beside the venv's: `make install`).
"""

from __future__ import annotations

import argparse
import enum
import io
import json
import math
import pickle
import re
import zipfile

import pytest
import torch

from fixtures import megatron_core as mc
from tests.conftest import ROOT, run_cli

pytestmark = pytest.mark.skipif(not mc.available(), reason="megatron-core is not installed")


class Saved(dict):
    """(model kind, TP, DP, bucket size[, megatron-core version[, (run option, value), …]]) → the
    folder megatron-core saved it in, made when first asked for; run options are
    `megatron_optim.write`'s (ep, pp, vpp, etp, tied, layers, mtp)."""

    def __init__(self, root) -> None:
        super().__init__()
        self.root = root

    def __missing__(self, key):
        from fixtures import megatron_optim

        kind, tp, dp, bucket, *rest = key
        version, run = (rest[0] if rest else None), dict(rest[1:])
        out = self.root / f"{kind}-tp{tp}dp{dp}b{bucket}{version or ''}{''.join(f'-{k}{v}' for k, v in run.items())}"
        megatron_optim.write(out, tp, dp, kind=kind, bucket_size=bucket or None, mcore=version, **run)
        self[key] = out
        return out


@pytest.fixture(scope="session")
def saved(tmp_path_factory):
    return Saved(tmp_path_factory.mktemp("megatron_optim"))


def needs(version: str):
    from fixtures import megatron_optim

    return pytest.mark.skipif(not megatron_optim.available(version),
                              reason=f"megatron-core {version} is not installed beside")


BUCKETS = ("llama", 2, 2, 1000, "0.19")
"""TP 2 × DP 2 with 1,000-element buckets, saved by megatron-core 0.19.2: seven buckets, params cut
at DP shard boundaries, the common state in the `common_state` item (args with an enum member)."""
BUCKETS_016 = ("llama", 2, 2, 1000)
"""The same saved by the venv's megatron-core 0.16.1 (the common state in `common.pt`)."""
MOE = ("qwen3-moe", 2, 1, 0)
"""A Qwen3-MoE at TP 2 (SequentialMLP experts in the dense buffer, q/k norms, a router)."""
DEEPSEEK = ("deepseek-v3", 2, 1, 1000, "0.19")
"""A DeepSeek-V3 at TP 2 with 1,000-element buckets (megatron-core 0.19.2): multi-latent attention,
a dense layer then a MoE one (per-layer keys), a shared expert, the router's expert bias (a
buffer: no optimizer state)."""
EXPERT_PARALLEL = ("qwen3-moe", 2, 2, 1000, "0.19", ("ep", 2))
"""A Qwen3-MoE at TP 2 × DP 2 with EP 2 (megatron-core 0.19.2): the experts in buffers and an
optimizer of their own, chained to the dense one (`chained_0.` / `chained_1.` entries, four
expert DP groups, one per EP × TP rank), buckets of 1,000 elements."""
PIPELINE = ("llama", 2, 1, 1000, "0.19", ("pp", 2))
"""A llama at TP 2 × PP 2 (megatron-core 0.19.2, trained by its pipeline schedule): each stage's
buffers of its own (four DP groups, one per PP × TP rank: the embedding and layer 0 on the first
stage, layer 1, the final norm and the output layer on the last), buckets of 1,000 elements."""
TIED_PIPELINE = ("llama", 2, 1, 0, "0.19", ("pp", 2), ("tied", True))
"""A llama whose embedding is tied to its output layer, at TP 2 × PP 2: the last stage's output
layer is a copy of the embedding, and either copy is in a bucket of its own. (megatron-core
0.19.2 cannot save this run with `bucket_size` buckets at all: its plan fails validation.)"""
EP_PIPELINE = ("qwen3-moe", 1, 2, 1000, "0.19", ("ep", 2), ("pp", 2))
"""A Qwen3-MoE at DP 2 × EP 2 × PP 2: the dense and expert optimizers' groups on each stage."""
VIRTUAL_PIPELINE = ("llama", 1, 1, 1000, "0.19", ("pp", 2), ("vpp", 2), ("layers", 4))
"""A 4-layer llama at PP 2 with two model chunks per stage (interleaved: layers 0 and 2 on the
first stage, 1 and 3 on the last), a buffer per chunk, the first chunk's cut in buckets."""
UNEVEN_PIPELINES = [
    ("llama", 1, 1, 1000, "0.19", ("pp", 2), ("layers", 4), ("first", 1)),
    ("llama", 1, 1, 1000, "0.19", ("pp", 2), ("vpp", 2), ("layers", 6), ("first", 2)),
    ("llama", 1, 1, 1000, "0.19", ("pp", 2), ("vpp", 2), ("layers", 6), ("count_embedding", True),
     ("count_loss", True))]
"""Layers split unevenly over PP 2: layer 0 on the first stage, 1–3 on the last
(`--decoder-first-pipeline-num-layers 1`); with two model chunks per stage, layers 0 | 1 2 | 3 |
4 5 over the virtual stages (a first stage of 2); and the embedding and the loss each counted as
a layer of the first and last virtual stage: layers 0 | 1 2 | 3 4 | 5."""
BF16 = ("llama", 1, 2, 1000, "0.19", ("bf16", True))
"""The bucketed run in bf16, as Megatron-LM trains (`--bf16`: the model in a Float16Module, its
params bf16, the optimizer's fp32 main params in `dtype_(torch.bfloat16, torch.float32)` buffers)."""
LAYOUT_PIPELINE = ("llama", 1, 1, 1000, "0.19", ("pp", 2), ("vpp", 2), ("layers", 4), ("layout", "E|tt|tt|L"))
"""A 4-layer llama at PP 2 × VPP 2 in a custom layout (`--pipeline-model-parallel-layout`): the
embedding alone in the first virtual stage, layers 0 1 | 2 3 in the next two, the final norm and
the output layer alone in the last."""
MTP_PIPELINE = ("llama", 1, 1, 0, "0.19", ("pp", 2), ("mtp", 1))
"""A llama with a multi-token prediction layer at PP 2: the last stage holds it and an embedding
of its own that it reads, in a bucket of its own, as the first stage's is. (megatron-core 0.19.2
cannot save it with `bucket_size` buckets: its plan fails validation, as for a tied embedding.)"""
EXPERT_TP = ("qwen3-moe", 2, 2, 1000, "0.19", ("ep", 2), ("etp", 1))
"""The Qwen3-MoE at TP 2 × DP 2 × EP 2 with an expert TP of 1: the experts whole in each EP rank's
expert buckets (two expert DP groups)."""
OPTIMIZER_INSTANCES = ("llama", 1, 4, 1000, "0.19", ("instances", 2))
"""A llama at DP 4 with two distributed optimizer instances (`--num-distributed-optimizer-instances
2`): each instance shards the optimizer over two DP ranks and one instance saves it, so its
buckets are padded and cut for two ranks although args say DP 4."""
GDN_BUCKETS = ("qwen3-next", 1, 2, 1000, "0.19")
"""A dense Qwen3-Next at DP 2 with 1,000-element buckets (megatron-core 0.19.2): layer 0 Gated
DeltaNet linear attention (`in_proj` and `conv1d` saved in parts, `in_proj.weight.query` …),
layer 1 gated softmax attention; per-layer keys."""
GDN_TP = ("qwen3-next", 2, 1, 0, "0.19")
"""The same model at TP 2, one bucket per buffer: each TP block of `in_proj` is its six parts'."""
MAMBA_BUCKETS = ("nemotron-h", 1, 2, 1000, "0.19")
"""A Nemotron-H-like MambaModel at DP 2 with 1,000-element buckets (megatron-core 0.19.2): a Mamba
layer (`mixer.in_proj` and `mixer.conv1d` saved in parts, `in_proj.weight.z` …), an attention
layer and an MLP layer; per-layer keys."""
MAMBA_TP = ("nemotron-h", 2, 1, 0, "0.19")
"""The same model at TP 2, one bucket per buffer."""
CONTEXT_PARALLEL = ("llama", 1, 2, 1000, "0.19", ("cp", 2))
"""A llama at DP 2 × CP 2 with 1,000-element buckets (megatron-core 0.19.2): its DDP buffers and
optimizer shard over the four DP × CP ranks, so each bucket is padded and cut for four; its step
takes set gradients (`fixtures.megatron_optim.write`: the local attention refuses CP on CPU)."""
CONTEXT_PARALLEL_TP = ("llama", 2, 1, 0, "0.19", ("cp", 2))
"""The same at TP 2 × CP 2, one bucket per buffer."""
TE_ORDER = ("llama", 2, 2, 1000, "0.19", ("order", "te"))
"""The bucketed llama with its params registered in Transformer Engine's order (a stand-in with
TE's names and order, built from the local modules it fuses: `fixtures.registration_orders`):
each layer's norms inside `linear_qkv` and `linear_fc1`, registered before their weights, after
`linear_proj`. The local spec's table does not lay it out; content does."""
PERMUTED = ("llama", 2, 2, 1000, "0.19", ("order", "permuted"))
"""The bucketed llama in a custom order no spec has (the MLP before the attention, `linear_qkv`
before `linear_proj`, the output layer first and the embedding last)."""
LAYOUTS = [pytest.param(BUCKETS, marks=needs("0.19")), pytest.param(BUCKETS_016, marks=pytest.mark.full),
           pytest.param(MOE, marks=pytest.mark.full), pytest.param(DEEPSEEK, marks=(needs("0.19"), pytest.mark.full)),
           pytest.param(EXPERT_PARALLEL, marks=(needs("0.19"), pytest.mark.full)),
           pytest.param(PIPELINE, marks=(needs("0.19"), pytest.mark.full)),
           pytest.param(EP_PIPELINE, marks=(needs("0.19"), pytest.mark.full)),
           pytest.param(EXPERT_TP, marks=needs("0.19")),
           pytest.param(TIED_PIPELINE, marks=(needs("0.19"), pytest.mark.full)),
           pytest.param(VIRTUAL_PIPELINE, marks=(needs("0.19"), pytest.mark.full)),
           pytest.param(("qwen2", 2, 1, 1000, "0.19"), marks=(needs("0.19"), pytest.mark.full)),
           pytest.param((*DEEPSEEK, ("mtp", 1)), marks=(needs("0.19"), pytest.mark.full)),
           pytest.param(UNEVEN_PIPELINES[1], marks=(needs("0.19"), pytest.mark.full)),
           pytest.param(MTP_PIPELINE, marks=(needs("0.19"), pytest.mark.full)),
           pytest.param(LAYOUT_PIPELINE, marks=needs("0.19")), pytest.param(BF16, marks=(needs("0.19"), pytest.mark.full)),
           pytest.param((*MTP_PIPELINE[:6], ("vpp", 2), ("layers", 4), ("mtp", 1)),
                        marks=(needs("0.19"), pytest.mark.full)),
           pytest.param(OPTIMIZER_INSTANCES, marks=(needs("0.19"), pytest.mark.full)),
           pytest.param(GDN_BUCKETS, marks=(needs("0.19"), pytest.mark.full)),
           pytest.param(GDN_TP, marks=(needs("0.19"), pytest.mark.full)),
           pytest.param(MAMBA_BUCKETS, marks=(needs("0.19"), pytest.mark.full)),
           pytest.param(MAMBA_TP, marks=(needs("0.19"), pytest.mark.full)),
           pytest.param(CONTEXT_PARALLEL, marks=(needs("0.19"), pytest.mark.full)),
           *(pytest.param(case, marks=(needs("0.19"), pytest.mark.full)) for case in UNEVEN_PIPELINES[::2])]
LOCAL_LAYOUTS = list(LAYOUTS)
"""The runs of the local spec: its table lays them out too."""
LAYOUTS += [pytest.param(TE_ORDER, marks=needs("0.19")), pytest.param(PERMUTED, marks=(needs("0.19"), pytest.mark.full))]


def case_id(case) -> str:
    """A saved run's test id: its kind, megatron-core version and run options."""
    return "-".join(str(v) if not isinstance(v, tuple) else f"{v[0]}{v[1]}" for v in (case[0], *case[4:]))
FS_MODEL_SPACE = ROOT / "fixtures" / "data" / "megatron_fs_model_space"
"""megatron-core 0.15.3's `fully_sharded_model_space` save of the bucketed run, committed
(`make fixtures` writes it again): the tests that rebuild it need no megatron-core 0.15."""


@pytest.fixture(scope="session")
def rebuilt(saved, tmp_path_factory):
    """The bucketed save rewritten by reshard (`--verify`)."""
    out = tmp_path_factory.mktemp("rebuilt") / "ckpt"
    run = run_cli("reshard", saved[BUCKETS] / "dp_reshardable", out, "--verify")
    assert run.returncode == 0, run.stderr
    return out


def _load(path):
    from fixtures.make_fixtures import load_with_torch

    return {k: v for k, v in load_with_torch(path).items() if isinstance(v, torch.Tensor)}


def _rewritten_as_its_own(ckpt, out) -> tuple[dict, dict]:
    """`reshard --verify` of run `ckpt`'s dp_reshardable save into `out`, asserted to be megatron-core's
    own fully_reshardable save of the run tensor for tensor, with the same common state; both returned."""
    from ckptctl.formats.dcp.metadata import open_checkpoint
    from ckptctl.formats.megatron_args import common_state

    run = run_cli("reshard", ckpt / "dp_reshardable", out, "--verify")
    assert run.returncode == 0, run.stderr
    got, want = _load(out), _load(ckpt / "fully_reshardable")
    assert sorted(got) == sorted(want) and all(torch.equal(got[k], want[k]) for k in want)
    mine, theirs = (common_state(open_checkpoint(p)).state for p in (out, ckpt / "fully_reshardable"))
    assert mine == theirs
    return got, mine


@needs("0.19")
def test_inspect_names_the_optimizer_format_and_labels_buckets(saved):
    ckpt = saved[BUCKETS]
    doc = json.loads(run_cli("inspect", ckpt / "dp_reshardable", "--json").stdout)
    assert doc["optimizer_format"] == "dp_reshardable" and not doc["problems"]
    buckets = {k: t for k, t in doc["tensors"].items() if k.startswith("optimizer.distributed.")}
    assert len(buckets) == 2 * 7 * 3 and {t["layout"] for t in buckets.values()} == {"bucketed"}
    doc = json.loads(run_cli("inspect", ckpt / "fully_reshardable", "--json").stdout)
    assert doc["optimizer_format"] == "fully_reshardable" and not doc["problems"]
    state = doc["tensors"]["optimizer.state.exp_avg.decoder.layers.mlp.linear_fc1.weight"]
    assert (state["layout"], state["param"]) == ("layer-stacked", "decoder.layers.mlp.linear_fc1.weight")
    assert doc["prefixes"]["optimizer"] == ["optimizer.state."]
    assert doc["training"] == {"from": "common_state/shard_0_1", "tp": 2, "pp": 1, "vpp": None, "dp": 2, "ep": 1,
                               "etp": 2, "cp": 1, "iteration": 1, "first_stage_layers": None,
                               "last_stage_layers": None, "optimizer_instances": 1, "pipeline_layout": None,
                               "problem": None}
    assert doc["megatron_core"] == {"versions": "0.19 or newer", "evidence": "common state in the common_state/shard_0_1 item"}
    text = run_cli("inspect", ckpt / "dp_reshardable").stdout
    assert re.search(r"^Training\s+TP 2 × PP 1 × DP 2 \(EP 1, CP 1\), iteration 1 \(args in common_state/shard_0_1\)\s*$",
                     text, re.M)
    assert re.search(r"^Saved by\s+megatron-core 0\.19 or newer \(common state in the common_state/shard_0_1 item\)\s*$",
                     text, re.M)
    assert re.search(r"^Optimizer\s+DistributedOptimizer, dp_reshardable: DP bucket buffers \(a job at another TP or "
                     r"PP cannot load them\)\s*$", text, re.M)


@pytest.mark.parametrize("case", LAYOUTS, ids=case_id)
def test_the_rebuilt_bucket_layout_is_megatron_cores_own(saved, case):
    """Every optimizer's buckets, in each of its DP groups and buffers (one per model chunk), hold
    the params megatron-core put there (each expert of each layer too, an EP rank's share of them
    in its expert optimizer's groups), at the same ranges."""
    from ckptctl.formats.dcp.metadata import open_checkpoint
    from ckptctl.planners.torch_dist import dp_reshardable_buckets, read_common

    ckpt = open_checkpoint(saved[case] / "dp_reshardable")
    common = read_common(ckpt)
    buckets, _ = dp_reshardable_buckets(ckpt, common, common.state["args"])
    got = {(b.chain, b.group, b.buffer, b.number): [(p.key, p.lead, s, e) for p, s, e in b.params] for b in buckets}
    record = json.loads((saved[case] / "buffers.json").read_text())
    tp, chained = case[1], bool(record["expert_parallel_buffers"])
    want = {}
    for rank in record["ranks"]:
        for experts, buffers in ((False, rank["buffers"]), (True, rank["expert_parallel_buffers"])):
            if rank["expert_dp_rank" if experts else "dp_rank"] or not buffers:
                continue
            # groups: (PP rank × EP + EP rank) × TP + TP rank, the experts' by their own TP
            ep, split, at = ((record["ep"], record["etp"] or tp, rank["etp_rank"]) if experts
                             else (1, tp, rank["tp_rank"]))
            group = (rank["pp_rank"] * ep + (rank["ep_rank"] if experts else 0)) * split + at
            for index, buffer in enumerate(buffers):
                params = {p["name"]: p for p in buffer["params"]}
                for bucket in buffer["buckets"]:
                    rows = []
                    for name in bucket["params"]:
                        p = params[name]
                        shard = p["sharded"]["shards"][0]  # its stacked dims: layer and global expert, as keyed
                        rows.append((p["sharded"]["key"], tuple(shard["global_offset"][:shard["prepend_axis_num"]]),
                                     p["start"] - bucket["offset"], p["end"] - bucket["offset"]))
                    want[(int(experts) if chained else None, group, index, bucket["bucket_id"])] = rows
    assert got == want


def _bucket_map(ckpt, monkeypatch=None) -> dict:
    """The params laid out in each bucket of `ckpt`: by content, or (given `monkeypatch`) by the
    local spec's table."""
    from ckptctl.megatron import buckets as tables
    from ckptctl.planners import torch_dist
    from ckptctl.planners.torch_dist import dp_reshardable_buckets, read_common

    if monkeypatch is not None:
        monkeypatch.setattr(torch_dist, "content_order", lambda ckpt, read: tables.table_order)
    common = read_common(ckpt)
    found, _ = dp_reshardable_buckets(ckpt, common, common.state["args"])
    if monkeypatch is not None:
        monkeypatch.undo()
    return {(b.chain, b.group, b.buffer, b.number): [(p.key, p.lead, s, e) for p, s, e in b.params] for b in found}


@pytest.mark.parametrize("case", LOCAL_LAYOUTS, ids=case_id)
def test_the_bucket_map_found_by_content_is_the_local_spec_tables(saved, case, monkeypatch):
    """On every run of the local spec, the map found by content is the one its table lays out."""
    from ckptctl.formats.dcp.metadata import open_checkpoint

    ckpt = open_checkpoint(saved[case] / "dp_reshardable")
    found = _bucket_map(ckpt)
    assert found == _bucket_map(ckpt, monkeypatch) and found


def _extra_states(path) -> dict[str, bytes]:
    """Every `_extra_state` item of a torch_dist checkpoint, as its raw saved bytes."""
    from ckptctl.formats.dcp.items import ItemReader
    from ckptctl.formats.dcp.metadata import open_checkpoint

    ckpt = open_checkpoint(path)
    with ItemReader(ckpt) as reader:
        return {fqn: reader.read_item_bytes(e.file, e.offset, e.length, e.transforms)
                for fqn, e in ckpt.bytes_entries.items() if "._extra_state/" in fqn}


@needs("0.19")
@pytest.mark.parametrize("order", [pytest.param("te", marks=pytest.mark.full),  # make test: TE's order by
                                   pytest.param("permuted", marks=pytest.mark.full)])  # its bucketed run and MLA run
def test_a_run_in_another_registration_order_is_rebuilt_as_megatron_cores_own_save(saved, tmp_path, order,
                                                                                   monkeypatch):
    """A run whose params register in Transformer Engine's order (the stand-in) or a custom one,
    one bucket per buffer: the rewrite equals megatron-core's own `fully_reshardable` save of the
    run tensor for tensor, with the same common state, and carries every `_extra_state` item as
    saved (TE's: a pickle in a uint8 tensor, or an empty one), byte for byte. Args naming
    Transformer Engine (before, refused by name) do not stop it. The local spec's table cannot lay
    it out: refused."""
    from fixtures.registration_orders import EXTRA_STATE
    from ckptctl.formats.dcp.metadata import open_checkpoint
    from ckptctl.util.errors import CheckpointError

    ckpt = saved[("llama", 2, 2, 0, "0.19", ("order", order))]
    got, common = _rewritten_as_its_own(ckpt, tmp_path / "o")
    assert len(got) == 36 and common["args"].transformer_impl == ("transformer_engine" if order == "te" else "local")
    extra = _extra_states(tmp_path / "o")  # each linear's, per layer (a ShardedObject: `shard_<layer>_2`)
    assert extra == _extra_states(ckpt / "dp_reshardable") and len(extra) == 4 * 2
    if order == "te":  # read back by the test (torch's loader, weights only): a pickle's bytes, or none
        [qkv], [fc1] = (torch.load(io.BytesIO(extra[f"decoder.layers.{name}._extra_state/shard_1_2"]),
                                   weights_only=True) for name in ("self_attention.linear_qkv", "mlp.linear_fc1"))
        assert (bytes(qkv.numpy()), fc1.dtype, fc1.numel()) == (EXTRA_STATE, torch.uint8, 0)
    with pytest.raises(CheckpointError, match="crosses a parameter boundary of the layout rebuilt: another model "
                                              "spec or megatron-core version"):
        _bucket_map(open_checkpoint(ckpt / "dp_reshardable"), monkeypatch)


TE_DEEPSEEK = ("deepseek-v3", 1, 2, 0, "0.19", ("order", "te"))
"""A DeepSeek-V3 in Transformer Engine's order (the stand-in, `fixtures.registration_orders`) at
TP 1 × DP 2, one bucket per buffer: MLA's q/kv norms fused into the up projections
(`layer_norm_weight`), the MoE layer's experts registered as TEGroupedMLP registers them (every
expert's fc1, then every expert's fc2). TP 1: TE's MLA down projections are duplicated, which
column-parallel equals only there."""


@needs("0.19")
def test_te_multi_latent_attention_and_grouped_experts_are_rebuilt_as_megatron_cores_own_save(saved, tmp_path,
                                                                                              monkeypatch):
    """The rewrite of the TE-ordered DeepSeek-V3 equals megatron-core's own `fully_reshardable`
    save tensor for tensor: the fused MLA norms are replicated params of the table, the grouped
    experts are SequentialMLP's stacks (TEGroupedMLP saves those keys), found by content; each
    master equals its weight."""
    from ckptctl.formats.dcp.metadata import open_checkpoint
    from ckptctl.util.errors import CheckpointError

    ckpt = saved[TE_DEEPSEEK]
    got, _ = _rewritten_as_its_own(ckpt, tmp_path / "o")
    model = open_checkpoint(ckpt / "dp_reshardable").tensors
    attention = "decoder.layers.{}.self_attention.linear_{}_up_proj.layer_norm_weight"
    fused = [attention.format(layer, p) for layer in (0, 1) for p in ("q", "kv")]
    assert all(k in model for k in fused)
    assert not any("q_layernorm" in k or "kv_layernorm" in k for k in model)
    fc1 = "decoder.layers.1.mlp.experts.experts.linear_fc1.weight"
    assert model[fc1].shape[0] == 4  # [E, …]: the per-expert params stacked by expert
    for key in (*fused, fc1):
        assert torch.equal(got[f"optimizer.state.param.{key}"], got[key].float())
    [bucket] = _bucket_map(open_checkpoint(ckpt / "dp_reshardable")).values()
    experts = [(key.rpartition("experts.")[2], lead) for key, lead, _, _ in bucket if ".experts.experts." in key]
    assert experts == [(f"linear_fc{i}.weight", (e,)) for i in (2, 1) for e in (3, 2, 1, 0)]  # registration reversed
    with pytest.raises(CheckpointError, match=r"bucket_idx_0\.param: the chunk \[15168, 16704\) crosses a parameter "
                                              "boundary of the layout rebuilt: another model spec or megatron-core "
                                              "version$"):  # the local spec's table: expert by expert
        _bucket_map(open_checkpoint(ckpt / "dp_reshardable"), monkeypatch)


def _trapped(path, marker) -> dict[str, bytes]:
    """Every `_extra_state` item of the torch_dist checkpoint at `path` overwritten, in place and
    at its length, with a pickle that creates file `marker` when anything unpickles it (the
    unpickler stops at its STOP, before the padding); the items' new bytes."""
    from ckptctl.formats.dcp.metadata import open_checkpoint

    trap = f"cos\nsystem\n(S'touch {marker}'\ntR.".encode()
    items = {fqn: e for fqn, e in open_checkpoint(path).bytes_entries.items() if "._extra_state/" in fqn}
    for entry in items.values():
        assert entry.length >= len(trap) and not entry.transforms
        with open(path / entry.file, "r+b") as f:
            f.seek(entry.offset)
            f.write(trap.ljust(entry.length, b" "))
    return {fqn: trap.ljust(e.length, b" ") for fqn, e in items.items()}


@needs("0.19")
def test_te_mla_norms_and_grouped_experts_export_and_extra_state_is_never_decoded(saved, tmp_path):
    """export-hf of the TE-ordered DeepSeek-V3 maps the fused MLA norms to HF's `q_a_layernorm` /
    `kv_a_layernorm` and TEGroupedMLP's experts (SequentialMLP's stacks) to HF's experts, exactly;
    its TE `_extra_state` items, each replaced by a pickle that would create a file if decoded,
    are left out by export-hf and carried byte for byte by reshard: the file is never created."""
    import shutil
    from safetensors.torch import load_file

    ckpt = tmp_path / "ckpt"
    shutil.copytree(saved[TE_DEEPSEEK] / "dp_reshardable", ckpt)
    model = _load(ckpt)
    marker = tmp_path / "decoded"
    trapped = _trapped(ckpt, marker)
    assert len(trapped) == 22  # every linear's (megatron-core's local ones save one too), per layer
    assert "decoder.layers.1.self_attention.linear_q_up_proj._extra_state/shard_0_1" in trapped

    class Called(pickle.Unpickler):  # the trap, decoded with its call recorded instead of made
        def find_class(self, module, name):
            return lambda *args: (module, name, args)

    assert {Called(io.BytesIO(b)).load() for b in trapped.values()} == {("os", "system", (f"touch {marker}",))}
    (tmp_path / "cfg").mkdir()
    (tmp_path / "cfg" / "config.json").write_text(json.dumps(mc.hf_config("deepseek-v3")))
    run = run_cli("export-hf", ckpt, tmp_path / "hf", "--hf-config", tmp_path / "cfg")
    assert run.returncode == 0, run.stderr
    hf = {k: v for f in sorted((tmp_path / "hf").glob("*.safetensors")) for k, v in load_file(f).items()}
    assert not any("extra" in k for k in hf)
    for layer in (0, 1):
        for hf_name, part in (("q_a_layernorm", "q"), ("kv_a_layernorm", "kv")):
            assert torch.equal(hf[f"model.layers.{layer}.self_attn.{hf_name}.weight"],
                               model[f"decoder.layers.{layer}.self_attention.linear_{part}_up_proj.layer_norm_weight"])
    fc2 = model["decoder.layers.1.mlp.experts.experts.linear_fc2.weight"]
    assert all(torch.equal(hf[f"model.layers.1.mlp.experts.{e}.down_proj.weight"], fc2[e]) for e in range(4))
    run = run_cli("reshard", ckpt, tmp_path / "o")
    assert run.returncode == 0, run.stderr
    assert _extra_states(tmp_path / "o") == trapped and not marker.exists()


TE_DEEPSEEK_LAYERNORM = ("deepseek-v3", 1, 2, 0, "0.19", ("order", "te-layernorm"))
"""`TE_DEEPSEEK` with MLA's q / kv norms LayerNorms (TE's LayerNormLinear under
`normalization="LayerNorm"`): each up projection registers `layer_norm_weight`, `layer_norm_bias`,
then `weight`."""


@needs("0.19")
@pytest.mark.full
def test_te_mla_layer_norm_bias_is_rebuilt_as_megatron_cores_own_save_and_export_refuses_it(saved, tmp_path):
    """The fused MLA norms' LayerNorm biases (`linear_q_up_proj` / `linear_kv_up_proj.layer_norm_bias`)
    are replicated params of the table, found by content after their weights in the buckets
    (registration reversed); the rewrite equals megatron-core's own `fully_reshardable` save tensor
    for tensor, each master its weight. DeepSeek-V3's HF norms have no bias: export-hf refuses."""
    from ckptctl.families.registry import megatron_tp_kind
    from ckptctl.formats.dcp.metadata import open_checkpoint

    ckpt = saved[TE_DEEPSEEK_LAYERNORM]
    got, _ = _rewritten_as_its_own(ckpt, tmp_path / "o")
    norms = [f"decoder.layers.{layer}.self_attention.linear_{part}_up_proj.layer_norm_{kind}"
             for layer in (0, 1) for part in ("q", "kv") for kind in ("weight", "bias")]
    for key in norms:
        assert megatron_tp_kind(key) == "replicated"
        assert torch.equal(got[f"optimizer.state.param.{key}"], got[key].float())
    bias = got["decoder.layers.0.self_attention.linear_q_up_proj.layer_norm_bias"]
    assert bias.shape == (mc.MLA["q_lora_rank"],) and bias.abs().min() > 0  # off its init (zeros), trained
    [bucket] = _bucket_map(open_checkpoint(ckpt / "dp_reshardable")).values()
    up = [key.rpartition(".")[2] for key, lead, _, _ in bucket if "layers.0.self_attention.linear_q_up_proj" in key]
    assert up == ["weight", "layer_norm_bias", "layer_norm_weight"]  # registration reversed
    (tmp_path / "cfg").mkdir()
    (tmp_path / "cfg" / "config.json").write_text(json.dumps(mc.hf_config("deepseek-v3")))
    run = run_cli("export-hf", ckpt / "dp_reshardable", tmp_path / "hf", "--hf-config", tmp_path / "cfg")
    assert (run.returncode, run.stderr) == (2, f"ckptctl: error: {ckpt / 'dp_reshardable'}: 4 model tensors have no "
                                               "place in a deepseek-v3 model of config.json: "
                                               + ", ".join(f"decoder.layers.{layer}.self_attention.linear_{part}_up_proj"
                                                           ".layer_norm_bias" for layer, part in
                                                           ((0, "kv"), (0, "q"), (1, "kv"))) +
                                               " (+1 more) (wrong --hf-config or --arch?)\n")
    assert not (tmp_path / "hf").exists()


@needs("0.19")
@pytest.mark.full
@pytest.mark.parametrize("ffn", [0, 13], ids=["aligned", "unaligned"])
def test_te_single_grouped_weight_is_rebuilt_as_megatron_cores_own_save_of_per_gemm_weights(saved, tmp_path, ffn):
    """Transformer Engine ≥ 2.14's single grouped weight (the stand-in `te-grouped`): each
    GroupedLinear one param [local experts, out, in], saved under the per-expert keys, laid out in
    the bucket as its experts' blocks back to back in expert order (expert blocks of 768 and
    1,536 elements lie on the 64-element grid; with an FFN of 13, fc2's 416 do not, and the next
    block starts unpadded). megatron-core cannot save that run's `fully_reshardable` state itself
    (no sharded tensor is the grouped param); ckptctl's map is megatron-core's `param_index_map`,
    and the rewrite equals megatron-core's own `fully_reshardable` save of the same training with
    per-GEMM weights (`te`) tensor for tensor (both runs unclipped: a clipped run's total gradient
    norm rounds by the params' grouping); export-hf writes its experts exactly."""
    from safetensors.torch import load_file

    from ckptctl.formats.dcp.metadata import open_checkpoint

    run = (*((("moe_ffn", ffn),) if ffn else ()), ("clip", 0.0))  # unclipped: two groupings train alike
    grouped = saved[("deepseek-v3", 1, 2, 0, "0.19", ("order", "te-grouped"), *run)]
    per_gemm = saved[("deepseek-v3", 1, 2, 0, "0.19", ("order", "te"), *run)]
    record = json.loads((grouped / "buffers.json").read_text())
    assert record["refused"]["fully_reshardable"].startswith("ValueError: Model param Parameter containing:")
    assert not (grouped / "fully_reshardable").exists()
    [bucket] = _bucket_map(open_checkpoint(grouped / "dp_reshardable")).values()
    want = []
    for p in record["buffers"][0]["params"]:
        if ".mlp.experts.linear_fc" in p["name"]:  # the grouped param: its experts' blocks in expert order
            experts, *block = p["local_shape"]
            size = math.prod(block)
            key = p["name"].replace(".mlp.experts.", ".mlp.experts.experts.")
            want += [(key, (e,), p["start"] + e * size, p["start"] + (e + 1) * size) for e in range(experts)]
    got = [row for row in bucket if ".experts.experts." in row[0]]
    assert got == want and len(got) == 8
    assert [start % 64 for _, _, start, _ in got[:4]] == ([0, 0, 0, 0] if not ffn else [0, 32, 0, 32])
    assert run_cli("inspect", grouped / "dp_reshardable", "--check").returncode == 0
    result = run_cli("reshard", grouped / "dp_reshardable", tmp_path / "o", "--verify")
    assert result.returncode == 0, result.stderr
    got, want = _load(tmp_path / "o"), _load(per_gemm / "fully_reshardable")
    assert sorted(got) == sorted(want) and all(torch.equal(got[k], want[k]) for k in want)
    assert torch.load(grouped / "loss.pt") == torch.load(per_gemm / "loss.pt")
    (tmp_path / "cfg").mkdir()
    config = mc.hf_config("deepseek-v3")
    config["moe_intermediate_size"] = ffn or config["moe_intermediate_size"]
    (tmp_path / "cfg" / "config.json").write_text(json.dumps(config))
    export = run_cli("export-hf", grouped / "dp_reshardable", tmp_path / "hf", "--hf-config", tmp_path / "cfg")
    assert export.returncode == 0, export.stderr
    hf = {k: v for f in sorted((tmp_path / "hf").glob("*.safetensors")) for k, v in load_file(f).items()}
    fc2 = got["decoder.layers.1.mlp.experts.experts.linear_fc2.weight"]
    assert all(torch.equal(hf[f"model.layers.1.mlp.experts.{e}.down_proj.weight"], fc2[e]) for e in range(4))


@needs("0.19")
@pytest.mark.full
def test_te_single_grouped_weight_under_expert_and_tensor_parallelism_in_several_buckets(saved, tmp_path):
    """A Qwen3-MoE at TP 2 × DP 2 × EP 2 with 1,000-element buckets, its GroupedLinears single
    grouped weights (`te-grouped`; fc2's TP-local expert blocks of 416 elements off the 64-element
    grid): each EP × TP rank's expert buckets are rebuilt as megatron-core laid them out (TP rank 1
    following the slabs content found on TP rank 0), and the rewrite equals the rewrite of the same
    unclipped training with per-GEMM weights (`te`) tensor for tensor (megatron-core's own
    `fully_reshardable` save of several buckets is wrong: module docstring)."""
    from ckptctl.formats.dcp.metadata import open_checkpoint

    run = (("ep", 2), ("moe_ffn", 26), ("clip", 0.0))
    grouped = saved[("qwen3-moe", 2, 2, 1000, "0.19", ("order", "te-grouped"), *run)]
    per_gemm = saved[("qwen3-moe", 2, 2, 1000, "0.19", ("order", "te"), *run)]
    record = json.loads((grouped / "buffers.json").read_text())
    found = _bucket_map(open_checkpoint(grouped / "dp_reshardable"))
    for rank in record["ranks"]:
        if rank["expert_dp_rank"]:
            continue
        group = rank["ep_rank"] * 2 + rank["etp_rank"]
        [buffer] = rank["expert_parallel_buffers"]
        params = {p["name"]: p for p in buffer["params"]}
        for bucket in buffer["buckets"]:
            want = []
            for name in bucket["params"]:
                p = params[name]
                experts, *block = p["local_shape"]
                size, layer = math.prod(block), int(name.split(".")[2])
                key = "decoder.layers." + name.split(".", 3)[3].replace("mlp.experts.", "mlp.experts.experts.")
                first = rank["ep_rank"] * experts
                want += [(key, (layer, first + e), p["start"] - bucket["offset"] + e * size,
                          p["start"] - bucket["offset"] + (e + 1) * size) for e in range(experts)]
            assert found[(1, group, 0, bucket["bucket_id"])] == want
    assert {s % 64 for rows in found.values() for key, _, s, _ in rows if "linear_fc2" in key} == {0, 32}
    for ckpt, out in ((grouped, "g"), (per_gemm, "p")):
        result = run_cli("reshard", ckpt / "dp_reshardable", tmp_path / out, "--verify")
        assert result.returncode == 0, result.stderr
    got, want = _load(tmp_path / "g"), _load(tmp_path / "p")
    assert sorted(got) == sorted(want) and all(torch.equal(got[k], want[k]) for k in want)
    assert torch.load(grouped / "loss.pt") == torch.load(per_gemm / "loss.pt")


def _overwrite(path, fqn: str, points: list[tuple[int, ...]], values: bytes) -> None:
    """Write `values` (raw, one element per point) over elements `points` of tensor `fqn` where
    the checkpoint at `path` saved them."""
    from ckptctl.engine.cpu import ChunkSource
    from ckptctl.formats.dcp.metadata import open_checkpoint

    ckpt = open_checkpoint(path)
    entry = ckpt.tensors[fqn]
    size = entry.dtype.itemsize
    chunks = ChunkSource(ckpt)
    try:
        for n, point in enumerate(points):
            chunk = next(c for c in entry.chunks
                         if all(o <= p < o + k for o, k, p in zip(c.offsets, c.sizes, point)))
            flat = 0
            for p, o, k in zip(point, chunk.offsets, chunk.sizes):
                flat = flat * k + p - o
            record = chunks.record(fqn, chunk)
            with open(record.path, "r+b") as f:
                f.seek(record.byte_offset + flat * size)
                f.write(values[n * size:(n + 1) * size])
    finally:
        chunks.close()


@needs("0.19")
def test_params_of_one_size_with_equal_masters_out_of_the_tables_order_are_refused_naming_them(saved, tmp_path):
    """The Transformer Engine order's run, one bucket per buffer, its layer 0 attention norm made
    its MLP norm's twin (weight and both TP ranks' fp32 masters, saved bytes overwritten): content
    cannot tell their places apart, and the buffer no longer follows the local spec's table there."""
    import shutil

    from ckptctl.engine.elements import ElementReader
    from ckptctl.formats.dcp.metadata import open_checkpoint

    src = tmp_path / "src"
    shutil.copytree(saved[("llama", 2, 2, 0, "0.19", ("order", "te"))] / "dp_reshardable", src)
    ckpt = open_checkpoint(src)
    laid = _bucket_map(ckpt)
    mlp, attention = "decoder.layers.mlp.linear_fc1.layer_norm_weight", \
        "decoder.layers.self_attention.linear_qkv.layer_norm_weight"
    hidden = ckpt.tensors[mlp].shape[1]
    with ElementReader(ckpt) as reader:
        dtype = ckpt.tensors[mlp].dtype
        twin = reader.read(mlp, [(0, i) for i in range(hidden)], dtype)
        writes = [(attention, [(0, i) for i in range(hidden)], b"".join(twin))]
        for (_, group, _, _), params in laid.items():
            bucket = next(k for k in ckpt.tensors if k.startswith(f"optimizer.distributed.dp_group_idx_{group}.")
                          and k.endswith(".param"))
            start = {key: s for key, lead, s, _ in params if lead == (0,)}
            masters = reader.read(bucket, [(start[mlp] + i,) for i in range(hidden)], dtype)
            writes.append((bucket, [(start[attention] + i,) for i in range(hidden)], b"".join(masters)))
    for fqn, points, values in writes:
        _overwrite(src, fqn, points, values)
    run = run_cli("reshard", src, tmp_path / "o")
    bucket = "optimizer.distributed.dp_group_idx_0.gbuf_idx_0.dtype_(torch.float32, torch.float32).bucket_idx_0.param"
    start = {key: s for key, lead, s, _ in laid[(None, 0, 0, 0)] if lead == (0,)}[mlp]
    assert (run.returncode, run.stderr) == (2, f"ckptctl: error: {src}: {bucket}: at element {start}, {mlp}[0] and "
                                               f"{attention}[0] are of one size with equal fp32 masters: their "
                                               "places in the bucket cannot be told apart by content, nor by "
                                               "megatron-core's local spec order\n")
    assert not (tmp_path / "o").exists()


@needs("0.19")
@pytest.mark.full  # EP 2 × ETP 1 (`test_experts_with_a_tp_of_their_own_…`) rewrites a chained optimizer by default
def test_an_expert_parallel_rewrite_is_megatron_cores_own(saved, tmp_path):
    """A ChainedOptimizer's dp_reshardable state (EP 2: `chained_0.` dense, `chained_1.` experts)
    as one fully_reshardable state: inspect counts its entries as the optimizer's, export-hf
    leaves them out (before, they were refused as model tensors of no place); the rewrite
    equals megatron-core's own `fully_reshardable` save of the run tensor for tensor, with the
    same common state (each optimizer's param groups). The conversion to Megatron-FSDP refuses
    it by name."""
    ckpt = saved[EXPERT_PARALLEL]
    doc = json.loads(run_cli("inspect", ckpt / "dp_reshardable", "--json").stdout)
    assert (doc["optimizer_format"], doc["groups"]["optimizer"], doc["training"]["ep"]) == ("dp_reshardable", 102, 2)
    _, common = _rewritten_as_its_own(ckpt, tmp_path / "o")
    assert list(common["optimizer"]) == [0, 1]
    (tmp_path / "cfg").mkdir()
    (tmp_path / "cfg" / "config.json").write_text(json.dumps(mc.hf_config("qwen3-moe")))
    for name in ("dp_reshardable", "fully_reshardable"):  # chained entries are the optimizer's, not the model's
        run = run_cli("export-hf", ckpt / name, tmp_path / f"hf-{name}", "--hf-config", tmp_path / "cfg")
        assert run.returncode == 0, run.stderr
    run = run_cli("diff", tmp_path / "hf-dp_reshardable", tmp_path / "hf-fully_reshardable")
    assert (run.returncode, run.stdout) == (0, "45 tensors: 45 equal, 0 close, 0 differs\n")
    run = run_cli("reshard", ckpt / "dp_reshardable", tmp_path / "f", "--layout", "megatron-fsdp", "--dp", "4")
    assert (run.returncode, run.stderr) == (2, f"ckptctl: error: {ckpt / 'dp_reshardable'}: experts trained with "
                                               "expert parallelism (or their own TP) have an optimizer of their own, "
                                               "chained to the dense one: not converted to fsdp_dtensor yet\n")


@needs("0.19")
def test_experts_with_a_tp_of_their_own_are_rebuilt_as_megatron_cores_own_save(saved, tmp_path):
    """An expert TP of 1 under TP 2: the experts' buckets hold whole experts; the rewrite equals
    megatron-core's own `fully_reshardable` save tensor for tensor, with the same common state.
    (Before, it was refused: "experts with a TP of their own are not rebuilt yet".)"""
    ckpt = saved[EXPERT_TP]
    got, common = _rewritten_as_its_own(ckpt, tmp_path / "o")
    assert len(got) == 48 and common["args"].expert_tensor_parallel_size == 1
    text = run_cli("inspect", ckpt / "dp_reshardable").stdout  # the expert TP named where it is not the TP
    assert re.search(r"^Training\s+TP 2 × PP 1 × DP 2 \(EP 2, ETP 1, CP 1\), iteration 1 ", text, re.M)


@needs("0.19")
@pytest.mark.full
@pytest.mark.parametrize("case", [EXPERT_PARALLEL, EP_PIPELINE, EXPERT_TP], ids=("tp2", "pp2", "etp1"))
def test_an_expert_parallel_rewrite_resumes_at_another_ep_with_the_saved_runs_loss(saved, tmp_path, case):
    from fixtures import megatron_optim

    out = tmp_path / "o"
    run = run_cli("reshard", saved[case] / "dp_reshardable", out)
    assert run.returncode == 0, run.stderr
    want = torch.load(saved[case] / "loss.pt")
    got = megatron_optim.load(out, 1, 4, tmp_path / "loss.pt", kind="qwen3-moe", mcore="0.19", ep=4)
    assert (got["sharding_type"], got["step"], got["after_step"]) == (
        "fully_reshardable", want["step2"], want["after_step2"])


@needs("0.19")
@pytest.mark.full
def test_a_bf16_rewrite_keeps_fp32_main_params_and_resumes_with_the_saved_runs_loss(saved, tmp_path):
    """A bf16 run's buckets hold the optimizer's fp32 main params: the rewrite keeps them fp32,
    each rounding to its bf16 weight, and megatron-core resumes it at the saved grid bit for bit.
    Its export to HF is the independent mapping of its bf16 weights, tensor for tensor."""
    from safetensors.torch import load_file

    from fixtures import megatron_core as mc
    from fixtures import megatron_optim
    from tests.planners.test_torch_dist import megatron_to_hf

    out = tmp_path / "o"
    run = run_cli("reshard", saved[BF16] / "dp_reshardable", out, "--verify")
    assert run.returncode == 0, run.stderr
    got = _load(out)
    params = {k[len("optimizer.state.param."):]: v for k, v in got.items() if k.startswith("optimizer.state.param.")}
    assert len(params) == 9
    for key, main in params.items():
        assert (main.dtype, got[key].dtype) == (torch.float32, torch.bfloat16), key
        assert torch.equal(main.to(torch.bfloat16), got[key]), key
    want = torch.load(saved[BF16] / "loss.pt")
    same = megatron_optim.load(out, 1, 2, tmp_path / "saved.pt", mcore="0.19", bucket_size=1000, bf16=True)
    assert (same["sharding_type"], same["step"], same["after_step"]) == (
        "fully_reshardable", want["step2"], want["after_step2"])
    (tmp_path / "config").mkdir()
    (tmp_path / "config" / "config.json").write_text(json.dumps(mc.hf_config("llama")))
    run = run_cli("export-hf", saved[BF16] / "dp_reshardable", tmp_path / "hf", "--hf-config", tmp_path / "config")
    assert run.returncode == 0, run.stderr
    exported = load_file(tmp_path / "hf" / "model.safetensors")
    mapped = megatron_to_hf(_load(saved[BF16] / "dp_reshardable"), "llama")
    assert sorted(exported) == sorted(mapped)
    for name, tensor in mapped.items():
        assert tensor.dtype == torch.bfloat16 and torch.equal(exported[name], tensor), name


@needs("0.19")
@pytest.mark.full
def test_a_bf16_rewrite_resumes_at_another_tp_within_bf16s_precision(saved, tmp_path):
    """At TP 2 the bf16 run's sums round otherwise than at its TP 1: megatron-core resumes the
    rewrite there to within bf16's precision."""
    from fixtures import megatron_optim

    run = run_cli("reshard", saved[BF16] / "dp_reshardable", tmp_path / "o")
    assert run.returncode == 0, run.stderr
    want = torch.load(saved[BF16] / "loss.pt")
    other = megatron_optim.load(tmp_path / "o", 2, 1, tmp_path / "tp2.pt", mcore="0.19", bf16=True)
    assert (other["step"], other["after_step"]) == pytest.approx((want["step2"], want["after_step2"]), rel=1e-4)


@needs("0.19")
@pytest.mark.full  # a TP 2 × PP 2 training of its own; `make test` proves pipelined layouts on the VPP run's buckets
def test_a_pipelined_rewrite_resumes_without_pipeline_stages_with_the_saved_runs_loss(saved, tmp_path):
    """TP 2 × PP 2: each stage's buckets rebuilt (their layout is megatron-core's own:
    `test_the_rebuilt_bucket_layout_is_megatron_cores_own`), every param state its weight;
    megatron-core's own load of the rewrite at TP 2 × PP 1, which the bucketed source cannot load
    at, resumes the saved run bit for bit. Converted to Megatron-FSDP (which has no stages) it is
    the conversion of the rewrite."""
    from fixtures import megatron_optim

    out = tmp_path / "o"
    run = run_cli("reshard", saved[PIPELINE] / "dp_reshardable", out, "--verify")
    assert run.returncode == 0, run.stderr
    got = _load(out)
    params = {k: v for k, v in got.items() if k.startswith("optimizer.state.param.")}
    assert len(params) == 9 and all(torch.equal(v, got[k[len("optimizer.state.param."):]]) for k, v in params.items())
    want = torch.load(saved[PIPELINE] / "loss.pt")
    resumed = megatron_optim.load(out, 2, 1, tmp_path / "loss.pt", mcore="0.19")
    assert (resumed["sharding_type"], resumed["step"], resumed["after_step"]) == (
        "fully_reshardable", want["step2"], want["after_step2"])
    for name, src in (("from-buckets", saved[PIPELINE] / "dp_reshardable"), ("from-rewrite", out)):
        run = run_cli("reshard", src, tmp_path / name, "--layout", "megatron-fsdp", "--dp", "2")
        assert run.returncode == 0, run.stderr
    run = run_cli("diff", tmp_path / "from-buckets", tmp_path / "from-rewrite")
    assert (run.returncode, run.stdout) == (0, "68 tensors: 68 equal, 0 close, 0 differs; "
                                               "288 bytes entries: 288 equal, 0 differs\n")


@needs("0.19")
@pytest.mark.full
def test_a_rewrite_of_several_optimizer_instances_is_megatron_cores_own_and_resumes_at_other_grids(saved, tmp_path):
    """DP 4 in two distributed optimizer instances: inspect names them; the buckets (one instance's,
    for two ranks; their layout is megatron-core's own: `test_the_rebuilt_bucket_layout_is_megatron_cores_own`)
    rebuild the run's state, every param state its weight, which megatron-core resumes at DP 4 in
    one instance and at TP 2 × DP 2 bit for bit; converted to Megatron-FSDP in place they are the
    conversion of the rewrite. (megatron-core 0.19.2's own fully_reshardable save of this bucketed
    run is not its state: the bucket-end padding fault `fixtures.megatron_optim` names.)"""
    from fixtures import megatron_optim

    ckpt, out = saved[OPTIMIZER_INSTANCES], tmp_path / "o"
    text = run_cli("inspect", ckpt / "dp_reshardable").stdout
    assert re.search(r"^Training\s+TP 1 × PP 1 × DP 4 \(EP 1, CP 1, 2 distributed optimizer instances\), "
                     r"iteration 1 \(args in common_state/shard_0_1\)\s*$", text, re.M)
    run = run_cli("reshard", ckpt / "dp_reshardable", out, "--verify")
    assert run.returncode == 0, run.stderr
    got = _load(out)
    params = {k: v for k, v in got.items() if k.startswith("optimizer.state.param.")}
    assert len(params) == 9 and all(torch.equal(v, got[k[len("optimizer.state.param."):]]) for k, v in params.items())
    loss = torch.load(ckpt / "loss.pt")
    for tp, dp in ((1, 4), (2, 2)):
        resumed = megatron_optim.load(out, tp, dp, tmp_path / f"loss{tp}{dp}.pt", mcore="0.19")
        assert (resumed["sharding_type"], resumed["step"], resumed["after_step"]) == (
            "fully_reshardable", loss["step2"], loss["after_step2"]), (tp, dp)
    for name, src in (("from-buckets", ckpt / "dp_reshardable"), ("from-rewrite", out)):
        run = run_cli("reshard", src, tmp_path / name, "--layout", "megatron-fsdp", "--dp", "4")
        assert run.returncode == 0, run.stderr
    run = run_cli("diff", tmp_path / "from-buckets", tmp_path / "from-rewrite")
    assert run.returncode == 0 and re.fullmatch(r"(\d+) tensors: \1 equal, 0 close, 0 differs; "
                                                r"(\d+) bytes entries: \2 equal, 0 differs\n", run.stdout), run.stdout


@needs("0.19")
@pytest.mark.full
def test_context_parallel_buckets_are_rebuilt_as_megatron_cores_own_save(saved, tmp_path):
    """Under context parallelism the buckets are padded and cut for DP × CP ranks (their layout is
    megatron-core's own: `test_the_rebuilt_bucket_layout_is_megatron_cores_own`): at TP 2 × CP 2 the
    rewrite is megatron-core's own fully_reshardable save tensor for tensor, with the same common
    state, and megatron-core loads it at TP 2 × DP 2 without CP and steps as from its own save; at
    DP 2 × CP 2 with buckets every rebuilt param state is its weight. The conversion to Megatron-FSDP,
    which shards such a run over DP × CP ranks, refuses it by name."""
    from fixtures import megatron_optim

    ckpt, out = saved[CONTEXT_PARALLEL_TP], tmp_path / "tp2"
    text = run_cli("inspect", ckpt / "dp_reshardable").stdout
    assert re.search(r"^Training\s+TP 2 × PP 1 × DP 1 \(EP 1, CP 2\), iteration 1 ", text, re.M)
    got, common = _rewritten_as_its_own(ckpt, out)
    assert len(got) == 36 and common["args"].context_parallel_size == 2
    resumed = [megatron_optim.load(src, 2, 2, tmp_path / f"loss-{src.name}.pt", mcore="0.19")
               for src in (out, ckpt / "fully_reshardable")]
    assert [(r["sharding_type"], r["step"], r["after_step"]) for r in resumed] == [
        ("fully_reshardable", resumed[1]["step"], resumed[1]["after_step"])] * 2
    src, out = saved[CONTEXT_PARALLEL] / "dp_reshardable", tmp_path / "buckets"
    run = run_cli("reshard", src, out, "--verify")
    assert run.returncode == 0, run.stderr
    got = _load(out)
    params = {k: v for k, v in got.items() if k.startswith("optimizer.state.param.")}
    assert len(params) == 9 and all(torch.equal(v, got[k[len("optimizer.state.param."):]]) for k, v in params.items())
    run = run_cli("reshard", src, tmp_path / "fsdp", "--layout", "megatron-fsdp", "--dp", "2")
    assert (run.returncode, run.stderr) == (2, f"ckptctl: error: {src}: args.context_parallel_size is 2: Megatron-FSDP "
                                               "shards a context-parallel run over DP × CP ranks, not converted to "
                                               "fsdp_dtensor yet\n")


SPLIT_PARAMS = {
    "qwen3-next": (GDN_TP, GDN_BUCKETS, "decoder.layers.0.self_attention.in_proj.weight",
                   ("query", "key", "value", "z", "beta", "alpha"),
                   "decoder.layers.0.self_attention.in_proj.layer_norm_weight: GDN or Mamba projections are not "
                   "converted to fsdp_dtensor yet"),
    "nemotron-h": (MAMBA_TP, MAMBA_BUCKETS, "decoder.layers.0.mixer.in_proj.weight", ("z", "x", "B", "C", "dt"),
                   "decoder.layers.0.mixer.conv1d.weight.x: a Mamba mixer's in_proj or conv in dp_reshardable "
                   "buckets is not converted to fsdp_dtensor yet (fully_reshardable is)"),
}
"""Per model kind with params megatron-core saves in parts (Gated DeltaNet, Mamba): its TP 2 and
bucketed runs, its `in_proj` and the parts it is saved in, and the Megatron-FSDP refusal."""


@needs("0.19")
@pytest.mark.full
@pytest.mark.parametrize("kind", sorted(SPLIT_PARAMS))
def test_split_param_buckets_rebuild_megatron_cores_own_save_and_resume_with_the_saved_runs_loss(saved, tmp_path,
                                                                                                 kind):
    """Gated DeltaNet's and Mamba's buckets (their layout is megatron-core's own:
    `test_the_rebuilt_bucket_layout_is_megatron_cores_own`): at TP 2 the rewrite is megatron-core's
    own fully_reshardable save bit for bit, each TP block of `in_proj` and `conv1d` split into its
    parts' keys; from TP 1 × DP 2 with buckets megatron-core resumes the rewrite at its grid and at
    TP 2 with the saved run's loss bit for bit — for GDN the step on the loaded state only: without
    sequence parallelism megatron-core 0.19.2 does not sum GDN `out_norm`'s gradient over TP ranks,
    so a TP 2 step makes its copies differ (a checkpoint in model space keeps TP rank 0's).
    Megatron-FSDP conversion refuses both buckets by name (GDN's layers, Mamba's in_proj and conv)."""
    from fixtures import megatron_optim

    tp_run, bucketed, in_proj, parts, refusal = SPLIT_PARAMS[kind]
    out = tmp_path / "tp2"
    run = run_cli("reshard", saved[tp_run] / "dp_reshardable", out, "--verify")
    assert run.returncode == 0, run.stderr
    got, want = _load(out), _load(saved[tp_run] / "fully_reshardable")
    assert sorted(k for k in got if k.startswith(f"optimizer.state.exp_avg.{in_proj}")) == sorted(
        f"optimizer.state.exp_avg.{in_proj}.{part}" for part in parts)
    assert sorted(got) == sorted(want) and all(torch.equal(got[k], want[k]) for k in want)
    src, out = saved[bucketed] / "dp_reshardable", tmp_path / "o"
    run = run_cli("reshard", src, out, "--verify")
    assert run.returncode == 0, run.stderr
    loss = torch.load(saved[bucketed] / "loss.pt")
    for tp, dp in ((1, 2), (2, 1)):
        resumed = megatron_optim.load(out, tp, dp, tmp_path / f"loss{tp}{dp}.pt", kind=kind, mcore="0.19")
        assert (resumed["sharding_type"], resumed["step"]) == ("fully_reshardable", loss["step2"]), (tp, dp)
        if tp == 1 or kind != "qwen3-next":
            assert resumed["after_step"] == loss["after_step2"], (tp, dp)
    run = run_cli("reshard", src, tmp_path / "fsdp", "--layout", "megatron-fsdp", "--dp", "2")
    assert (run.returncode, run.stderr) == (2, f"ckptctl: error: {src}: {refusal}\n")


@needs("0.19")
@pytest.mark.full
def test_a_megatron_fsdp_gdn_checkpoint_converted_to_torch_dist_is_megatron_cores_own_save(saved, tmp_path):
    """Gated DeltaNet at TP 2 as Megatron-FSDP saves it (`in_proj` and `conv1d` fused, TP-blocked; the
    input norm under its local module name) converted to torch_dist: every tensor is megatron-core
    0.19.2's own torch_dist save of the run (`in_proj.weight.query` …, `conv1d.weight.query` …, the
    norm keyed `self_attention.in_proj.layer_norm_weight`), and 0.19.2 resumes it at TP 2 × DP 1 and
    TP 1 × DP 2 exactly as it resumes its own save (not the run's own next loss at TP 2: without
    sequence parallelism megatron-core does not sum GDN `out_norm`'s gradient over TP ranks)."""
    from fixtures import megatron_fsdp_dtensor, megatron_optim

    own = saved[GDN_TP] / "fully_reshardable"
    fsdp, out = tmp_path / "fsdp", tmp_path / "td"
    megatron_fsdp_dtensor.write(own, saved[GDN_TP] / "buffers.json", fsdp, 2, 1)
    run = run_cli("reshard", fsdp, out, "--layout", "torch-dist", "--verify")
    assert run.returncode == 0, run.stderr
    got, want = _load(out), _load(own)
    assert sorted(got) == sorted(want) and all(torch.equal(got[k], want[k]) for k in want)
    assert {f"decoder.layers.0.self_attention.in_proj.weight.{p}" for p in SPLIT_PARAMS["qwen3-next"][3]} | {
        "decoder.layers.0.self_attention.in_proj.layer_norm_weight"} <= set(got)
    for tp, dp in ((2, 1), (1, 2)):
        resumed, theirs = (megatron_optim.load(src, tp, dp, tmp_path / f"{name}{tp}.pt", kind="qwen3-next",
                                               mcore="0.19", strict="log_all") for name, src in (("td", out),
                                                                                                 ("own", own)))
        assert (resumed["sharding_type"], resumed["step"], resumed["after_step"]) == (
            "fully_reshardable", theirs["step"], theirs["after_step"]), (tp, dp)


@needs("0.19")
@pytest.mark.full
def test_a_hybrid_stack_under_pipeline_parallelism_is_refused_naming_it(saved, tmp_path):
    """megatron-core splits a hybrid (Mamba) stack over pipeline stages by its pattern's `|`
    segments, which the GPT decoder's split does not describe: its buckets are refused by name."""

    def pipelined(state):
        state[0]["args"].pipeline_model_parallel_size = 2
        return state

    src = _with_item(saved[MAMBA_BUCKETS] / "dp_reshardable", tmp_path / "pp2", "common_state/shard_0_1", pipelined)
    run = run_cli("reshard", src, tmp_path / "o")
    assert (run.returncode, run.stderr) == (2, f"ckptctl: error: {src}: decoder.final_norm.weight: "
                                               "a hybrid (Mamba) stack under pipeline parallelism is not rebuilt yet "
                                               "(megatron-core splits it by its pattern's '|' segments, not as a GPT "
                                               "decoder)\n")
    assert not (tmp_path / "o").exists()


@needs("0.15")
@pytest.mark.full
def test_megatron_core_0_15s_pipelined_states_are_rebuilt_as_its_own_save(saved, tmp_path):
    """megatron-core 0.15.3 at PP 2 (one bucket per stage): its stages save their param groups in
    the order their params meet them, so the last stage's differ in order from the first's.
    Both `dp_reshardable` and `fully_sharded_model_space` rewrite to its own `fully_reshardable`
    save, tensor for tensor and common state (the first stage's groups, as its save keeps rank
    0's); 0.15 resumes the rewrite at TP 1 × DP 2 with the saved run's loss."""
    from fixtures import megatron_optim

    from ckptctl.formats.dcp.metadata import open_checkpoint
    from ckptctl.formats.megatron_args import common_state

    ckpt = saved[("llama", 1, 1, 0, "0.15", ("pp", 2))]
    want = _load(ckpt / "fully_reshardable")
    theirs = common_state(open_checkpoint(ckpt / "fully_reshardable")).state
    for name in ("dp_reshardable", "fully_sharded_model_space"):
        run = run_cli("reshard", ckpt / name, tmp_path / name, "--verify")
        assert run.returncode == 0, run.stderr
        got = _load(tmp_path / name)
        assert sorted(got) == sorted(want) and all(torch.equal(got[k], want[k]) for k in want), name
        assert common_state(open_checkpoint(tmp_path / name)).state == theirs, name
    loss = torch.load(ckpt / "loss.pt")
    resumed = megatron_optim.load(tmp_path / "dp_reshardable", 1, 2, tmp_path / "loss.pt", mcore="0.15")
    assert (resumed["step"], resumed["after_step"]) == (loss["step2"], loss["after_step2"])


@needs("0.19")
@pytest.mark.full
def test_a_virtual_pipeline_rewrite_resumes_with_the_saved_runs_loss(saved, tmp_path):
    """Two model chunks per stage (a buffer each): megatron-core resumes the rewrite at its own
    grid (interleaved schedule) and at PP 1 × DP 2 bit for bit."""
    from fixtures import megatron_optim

    out = tmp_path / "o"
    text = run_cli("inspect", saved[VIRTUAL_PIPELINE] / "dp_reshardable").stdout
    assert re.search(r"^Training\s+TP 1 × PP 2 × DP 1 \(VPP 2, EP 1, CP 1\), iteration 1 ", text, re.M)
    run = run_cli("reshard", saved[VIRTUAL_PIPELINE] / "dp_reshardable", out, "--verify")
    assert run.returncode == 0, run.stderr
    want = torch.load(saved[VIRTUAL_PIPELINE] / "loss.pt")
    for dp, grid in ((1, dict(pp=2, vpp=2)), (2, {})):
        resumed = megatron_optim.load(out, 1, dp, tmp_path / f"loss{dp}.pt", mcore="0.19", layers=4, **grid)
        assert (resumed["step"], resumed["after_step"]) == (want["step2"], want["after_step2"]), grid


def test_pipeline_splits_are_megatron_cores_own():
    """For every split megatron-core builds (its `TransformerConfig` accepts it, and no stage gets
    fewer than 0 layers), `Pipeline.layer_counts` gives the split of its own
    `get_num_layers_to_build` and `get_transformer_layer_offset`, virtual stage by virtual stage
    (layer counts and offsets): even, uneven and counted splits, with and without virtual stages."""
    import itertools
    import warnings

    from megatron.core.transformer.transformer_block import get_num_layers_to_build
    from megatron.core.transformer.transformer_config import TransformerConfig
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    from ckptctl.megatron.buckets import Pipeline

    built = 0
    for layers, pp, vpp, first, last, embedding, loss in itertools.product(
            range(1, 13), (2, 3, 4), (1, 2, 3), (None, 1, 2, 4), (None, 1, 2, 3), (False, True), (False, True)):
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                config = TransformerConfig(
                    num_layers=layers, hidden_size=8, num_attention_heads=1, pipeline_dtype=torch.float32,
                    pipeline_model_parallel_size=pp, virtual_pipeline_model_parallel_size=vpp if vpp > 1 else None,
                    num_layers_in_first_pipeline_stage=first, num_layers_in_last_pipeline_stage=last,
                    account_for_embedding_in_pipeline_split=embedding, account_for_loss_in_pipeline_split=loss)
            theirs = [(get_transformer_layer_offset(config, chunk if vpp > 1 else None, stage),
                       get_num_layers_to_build(config, chunk if vpp > 1 else None, stage))
                      for chunk, stage in itertools.product(range(vpp), range(pp))]
        except (ValueError, AssertionError, ZeroDivisionError):  # a split megatron-core refuses
            continue
        if min(n for _, n in theirs) < 0:
            continue
        counts = Pipeline(pp, vpp, first, last, embedding, loss).layer_counts(layers)
        assert theirs == [(sum(counts[:v]), n) for v, n in enumerate(counts)], (layers, pp, vpp, first, last)
        built += 1
    assert built == 344


def test_pipeline_layouts_are_read_as_megatron_core_reads_them():
    """A `--pipeline-model-parallel-layout` string is each virtual stage's layers as megatron-core's
    own `parse_str_to_list` reads it (repeats, groups, cosmetic commas, empty stages); another
    letter, or a string that unrolls past the bound, is a ValueError before anything is built."""
    from megatron.core.transformer.enums import LayerType
    from megatron.core.transformer.pipeline_parallel_layer_layout import PipelineParallelLayerLayout

    from ckptctl.megatron.buckets import MAX_LAYOUT, parse_layout

    letters = {LayerType.embedding: "E", LayerType.loss: "L", LayerType.decoder: "t", LayerType.mtp: "m"}
    for text in ("Et*3|(tt|)*29,m|L", "E|tt|tt|L", "Et|(t|)*2,tL", "(Et|)*1t*2|L", "E,t,t|t,L", "|Et||tL|",
                 "(tt|)*3(t|)*2L", "Ettttt*0|L"):
        stages = PipelineParallelLayerLayout.parse_str_to_list(text)
        theirs = tuple("".join(letters[t] for t in stage) for stage in stages)
        assert parse_layout(text) == theirs, text
    assert parse_layout("Et*3|(tt|)*29,m|L") == ("Ettt", *["tt"] * 29, "m", "L")
    for text, why in (("Et|tX", "letters 'X' are not layers (E, L, t, m)"),
                      ("Et*70000|L", f"it unrolls to more than {MAX_LAYOUT} layers and stages"),
                      ("(t*1000|)*1000", f"it unrolls to more than {MAX_LAYOUT} layers and stages")):
        with pytest.raises(ValueError) as raised:
            parse_layout(text)
        assert str(raised.value) == why, text


@needs("0.19")
def test_inspect_names_the_pipeline_split(saved, tmp_path):
    """A custom layout and an uneven split (the layout run's args saying first and last stage
    sizes instead) are named on the Training line and in `--json`."""
    def uneven(state):
        state[0]["args"].pipeline_model_parallel_layout = None
        state[0]["args"].decoder_first_pipeline_num_layers = 1
        state[0]["args"].decoder_last_pipeline_num_layers = 3
        return state

    layout = saved[LAYOUT_PIPELINE] / "dp_reshardable"
    split = _with_item(layout, tmp_path / "split", "common_state/shard_0_1", uneven)
    for src, words, want in ((layout, "layout E|tt|tt|L", (None, None, "E|tt|tt|L")),
                             (split, "first stage 1 layers, last stage 3 layers", (1, 3, None))):
        text = run_cli("inspect", src).stdout
        assert re.search(rf"^Training\s+TP 1 × PP 2 × DP 1 \(VPP 2, EP 1, CP 1, {re.escape(words)}\), iteration 1 ",
                         text, re.M), text
        doc = json.loads(run_cli("inspect", src, "--json").stdout)["training"]
        assert (doc["first_stage_layers"], doc["last_stage_layers"], doc["pipeline_layout"]) == want


@pytest.mark.full
@pytest.mark.parametrize("case", [pytest.param(c, marks=needs("0.19")) for c in (*UNEVEN_PIPELINES, LAYOUT_PIPELINE)],
                         ids=case_id)
def test_an_unevenly_pipelined_rewrite_resumes_at_its_grid_and_without_stages_with_the_saved_runs_loss(
        saved, tmp_path, case):
    """Layers split unevenly over the stages, or in a custom layout (their buckets are megatron-core's own:
    `test_the_rebuilt_bucket_layout_is_megatron_cores_own`): megatron-core resumes the rewrite at
    the saved grid and split, and at PP 1, bit for bit (at DP 2 under virtual pipeline
    parallelism, whose schedule ran the batch as two microbatches: the same sums of gradients)."""
    from fixtures import megatron_optim

    out = tmp_path / "o"
    run = run_cli("reshard", saved[case] / "dp_reshardable", out, "--verify")
    assert run.returncode == 0, run.stderr
    want = torch.load(saved[case] / "loss.pt")
    grid = dict(case[5:])
    for name, dp, options in (("saved", 1, grid), ("pp1", grid.get("vpp", 1), {"layers": grid["layers"]})):
        resumed = megatron_optim.load(out, 1, dp, tmp_path / f"{name}.pt", mcore="0.19", **options)
        assert (resumed["sharding_type"], resumed["step"], resumed["after_step"]) == (
            "fully_reshardable", want["step2"], want["after_step2"]), name


@needs("0.19")
@pytest.mark.full
@pytest.mark.parametrize("options", [(("tied", False),), (("tied", True),), (("mtp", 1),),
                                     (("vpp", 2), ("layers", 4), ("mtp", 1))],
                         ids=("untied", "tied", "mtp", "vpp-mtp"))
def test_a_pipelined_rewrite_with_one_bucket_is_megatron_cores_own_and_resumes_at_other_grids(saved, tmp_path,
                                                                                              options):
    """TP 1 × PP 2 with one bucket per stage (an embedding both stages hold, a tied one or the one
    the last stage's multi-token prediction layers read, in buckets of its own on either): the
    rewrite equals megatron-core's own `fully_reshardable` save tensor for tensor, with the same
    common state; megatron-core resumes it at its grid and at DP 2 × PP 1 bit for bit."""
    from fixtures import megatron_optim

    ckpt = saved[("llama", 1, 1, 0, "0.19", ("pp", 2), *options)]
    out = tmp_path / "o"
    _rewritten_as_its_own(ckpt, out)
    loss = torch.load(ckpt / "loss.pt")
    grid = dict(options)
    for dp, pp in ((1, 2), (2, 1)):
        run_options = {**grid, "pp": pp} if pp > 1 else {k: v for k, v in grid.items() if k != "vpp"}
        resumed = megatron_optim.load(out, 1, dp, tmp_path / f"loss{dp}{pp}.pt", mcore="0.19", **run_options)
        assert (resumed["step"], resumed["after_step"]) == (loss["step2"], loss["after_step2"]), (dp, pp)


@needs("0.19")
def test_rebuilt_param_states_are_the_weights_and_buckets_are_gone(rebuilt):
    got = _load(rebuilt)
    params = {k: v for k, v in got.items() if k.startswith("optimizer.state.param.")}
    assert len(params) == 9 and not any(k.startswith("optimizer.distributed.") for k in got)
    for key, value in params.items():
        assert torch.equal(value, got[key[len("optimizer.state.param."):]]), key
    assert {k.split(".")[2] for k in got if k.startswith("optimizer.state.")} == {"param", "exp_avg", "exp_avg_sq"}
    doc = json.loads(run_cli("inspect", rebuilt, "--json").stdout)
    assert doc["optimizer_format"] == "fully_reshardable" and not doc["problems"]


@needs("0.19")
@pytest.mark.full
def test_megatron_core_resumes_the_rewrite_at_another_tp_with_the_saved_runs_loss(saved, rebuilt, tmp_path):
    """megatron-core's own load of the output at TP 1 × DP 2 (it cannot load the bucketed source
    there), then one step: the loss after it depends on every Adam state. (`make test` proves the
    same tensors through the Megatron-FSDP conversion, whose output holds every one of them and
    resumes with this loss; the rewritten common state is compared with megatron-core's own.)"""
    from fixtures import megatron_optim

    want = torch.load(saved[BUCKETS] / "loss.pt")
    got = megatron_optim.load(rebuilt, 1, 2, tmp_path / "loss.pt", bucket_size=None, mcore="0.19")
    assert (got["sharding_type"], got["step"], got["after_step"]) == (
        "fully_reshardable", want["step2"], want["after_step2"])


@needs("0.19")
def test_the_rewritten_common_state_item_is_megatron_cores_own_fully_reshardable_one(saved, rebuilt):
    """0.19 keeps the common state in the `common_state/shard_0_1` item, its args holding an enum
    member: rewritten without torch, it is what megatron-core's own `fully_reshardable` save of the
    same run holds (param groups, sharding type, content metadata), the enum member the same global
    and value; torch's `weights_only` loader reads it (megatron-core's enum allowed, as it allows it)."""
    from megatron.core.transformer.enums import AttnBackend as MegatronAttnBackend

    from ckptctl.formats.dcp.metadata import open_checkpoint
    from ckptctl.formats.megatron_args import COMMON_STATE, Opaque, common_state

    ckpt = open_checkpoint(rebuilt)
    got = common_state(ckpt)
    want = common_state(open_checkpoint(saved[BUCKETS] / "fully_reshardable"))
    assert (got.where, got.state) == (COMMON_STATE, want.state)
    assert got.state["args"].attention_backend == Opaque("megatron.core.transformer.enums", "AttnBackend", (5,))
    assert got.state["optimizer"]["param_state_sharding_type"] == "fully_reshardable"
    assert not (rebuilt / "common.pt").exists()
    entry = ckpt.bytes_entries[COMMON_STATE]
    raw = (rebuilt / entry.file).read_bytes()[entry.offset:entry.offset + entry.length]
    with torch.serialization.safe_globals([argparse.Namespace, MegatronAttnBackend]):
        (loaded,) = torch.load(io.BytesIO(raw), weights_only=True)
    assert loaded["args"].attention_backend is MegatronAttnBackend.auto
    assert loaded["content_metadata"] == want.state["content_metadata"]


@pytest.fixture(scope="session")
def fsdp_dtensor(saved, rebuilt, tmp_path_factory):
    """The rewritten state as Megatron-FSDP saves it at TP 2 × DP 2 (`fixtures.megatron_fsdp_dtensor`)."""
    from fixtures import megatron_fsdp_dtensor

    out = tmp_path_factory.mktemp("fsdp_dtensor") / "ckpt"
    megatron_fsdp_dtensor.write(rebuilt, saved[BUCKETS] / "buffers.json", out, 2, 2)
    return out


@needs("0.19")
def test_a_megatron_fsdp_checkpoint_converted_to_torch_dist_resumes_with_the_saved_runs_loss(saved, rebuilt,
                                                                                             fsdp_dtensor, tmp_path):
    """Megatron-FSDP's fsdp_dtensor (per-layer module names, fc1 split, the fp32 masters as the model,
    torch Adam's per-param steps and group settings) as torch_dist: every tensor is the state it
    holds (that of the rewrite it was made from), the param groups and step are megatron-core's
    own, and megatron-core 0.19.2 loads it at TP 1 × DP 2 (`--dist-ckpt-strictness log_all`:
    Megatron-FSDP saves no `_extra_state`) and resumes with the saved run's loss."""
    from fixtures import megatron_fsdp_dtensor, megatron_optim

    from ckptctl.formats.dcp.metadata import open_checkpoint
    from ckptctl.formats.megatron_args import Opaque, common_state

    out = tmp_path / "td"
    run = run_cli("reshard", fsdp_dtensor, out, "--layout", "torch-dist", "--verify")
    assert run.returncode == 0, run.stderr
    got, want = _load(out), _load(rebuilt)
    assert sorted(got) == sorted(want) and all(torch.equal(got[k], want[k]) for k in want)
    common, ref = common_state(open_checkpoint(out)).state, common_state(open_checkpoint(rebuilt)).state
    groups, ref_groups = common["optimizer"]["optimizer"]["param_groups"], ref["optimizer"]["optimizer"]["param_groups"]
    assert len(groups) == len(ref_groups) == 2 and all(g in ref_groups for g in groups)
    assert common["content_metadata"] == ref["content_metadata"] and common["iteration"] == 1
    assert common["opt_param_scheduler"] == megatron_fsdp_dtensor.SCHEDULER
    assert common["args"].attention_backend == Opaque("megatron.core.transformer.enums", "AttnBackend", (5,))
    assert json.loads((out / "metadata.json").read_text()) == {"sharded_backend": "torch_dist",
                                                               "sharded_backend_version": 1}
    doc = json.loads(run_cli("inspect", out, "--json").stdout)  # chunked as megatron-core chunks a layer stack
    assert {t["layout"] for k, t in doc["tensors"].items() if ".layers." in k} == {"layer-stacked"}
    (tmp_path / "hf-config").mkdir()
    (tmp_path / "hf-config" / "config.json").write_text(json.dumps(mc.hf_config("llama")))
    for name, src in (("converted", out), ("saved", saved[BUCKETS] / "fully_reshardable")):
        run = run_cli("export-hf", src, tmp_path / name, "--hf-config", tmp_path / "hf-config", "--arch", "llama")
        assert run.returncode == 0, run.stderr
    assert run_cli("diff", tmp_path / "converted", tmp_path / "saved").returncode == 0  # what megatron-core saved
    want = torch.load(saved[BUCKETS] / "loss.pt")
    resumed = megatron_optim.load(out, 1, 2, tmp_path / "loss.pt", mcore="0.19", strict="log_all")
    assert (resumed["sharding_type"], resumed["step"], resumed["after_step"]) == (
        "fully_reshardable", want["step2"], want["after_step2"])
    bf16 = _with_args(fsdp_dtensor, tmp_path / "bf16", bf16=True)  # a bf16 run: its model in bf16, masters fp32
    run = run_cli("reshard", bf16, tmp_path / "td16", "--layout", "torch-dist")
    assert run.returncode == 0, run.stderr
    got16 = _load(tmp_path / "td16")
    assert sorted(got16) == sorted(got)
    for key, value in got.items():
        cast = value if key.startswith("optimizer.") else value.to(torch.bfloat16)
        assert got16[key].dtype == cast.dtype and torch.equal(got16[key], cast), key


@needs("0.19")
def test_a_megatron_fsdp_checkpoint_whose_args_hold_an_enum_is_resharded_at_another_tp(fsdp_dtensor, tmp_path):
    """Megatron-LM's args hold enum members (`attention_backend`): the Megatron-aware reshard reads
    them without torch and writes them back as they were, with the new TP. A TP that does not
    divide the query groups is refused, as the torch_dist conversion refuses it."""
    out = tmp_path / "tp1"
    run = run_cli("reshard", fsdp_dtensor, out, "--layout", "megatron-fsdp", "--tp", "1", "--dp", "2", "--verify")
    assert run.returncode == 0, run.stderr
    args, want = _everything(out)["args"], _everything(fsdp_dtensor)["args"]
    assert vars(args) == {**vars(want), "tensor_model_parallel_size": 1, "expert_tensor_parallel_size": 1}
    assert type(args.attention_backend).__name__ == "AttnBackend" and args.attention_backend.name == "auto"
    run = run_cli("reshard", fsdp_dtensor, tmp_path / "tp4", "--layout", "megatron-fsdp", "--tp", "4", "--dp", "1")
    assert (run.returncode, run.stderr) == (2, "ckptctl: error: TP 4 does not divide the 2 query groups of args\n")
    assert not (tmp_path / "tp4").exists()  # Megatron could not load it: its qkv rows divide, its groups do not


def _with_args(src, dst, **changes):
    """A copy of DCP checkpoint `src` whose `args` item says `changes` too."""
    return _with_item(src, dst, "args", lambda args: argparse.Namespace(**{**vars(args), **changes}))


def _with_item(src, dst, fqn, change):
    """A copy of DCP checkpoint `src` whose bytes item `fqn` holds `change(value)` (a new item at the
    end of its file, `.metadata` pointing there, written by torch's own classes)."""
    import dataclasses
    import shutil

    from torch.distributed.checkpoint import FileSystemReader

    shutil.copytree(src, dst)
    md = FileSystemReader(str(dst)).read_metadata()
    index = next(i for i in md.storage_data if i.fqn == fqn)
    info = md.storage_data[index]
    path = dst / info.relative_path
    raw = path.read_bytes()[info.offset:info.offset + info.length]
    buf = io.BytesIO()
    torch.save(change(torch.load(io.BytesIO(raw), weights_only=False)), buf)
    with open(path, "ab") as f:
        offset = f.seek(0, 2)
        f.write(buf.getvalue())
    md.storage_data[index] = dataclasses.replace(info, offset=offset, length=len(buf.getvalue()))
    (dst / ".metadata").write_bytes(pickle.dumps(md))
    return dst


def _everything(path) -> dict:
    """Every entry of a DCP checkpoint by its flattened name, as torch's own reader loads it."""
    from fixtures.make_fixtures import load_with_torch

    def flat(node, prefix=""):
        for key, value in node.items():
            if isinstance(value, dict):
                yield from flat(value, f"{prefix}{key}.")
            else:
                yield f"{prefix}{key}", value

    return dict(flat(load_with_torch(path)))


def _same(got, want) -> bool:
    if isinstance(want, torch.Tensor):
        return isinstance(got, torch.Tensor) and got.dtype == want.dtype and torch.equal(got, want)
    return type(got) is type(want) and (vars(got) == vars(want) if isinstance(want, argparse.Namespace) else got == want)


def _converted_is_megatron_fsdps_save(src, save, out, params: int, *grid: str) -> tuple[dict, dict]:
    """Convert torch_dist `src` to fsdp_dtensor `out` at `grid` and check it against Megatron-FSDP's
    `save` of the same state: equal where both have an entry; the source has no scheduler, flop
    count or RNG state; the output keeps the step in each of the `params` groups too. Returns the
    output's entries and the save's."""
    from fixtures import megatron_fsdp_dtensor

    run = run_cli("reshard", src, out, "--layout", "megatron-fsdp", *grid, "--verify")
    assert run.returncode == 0, run.stderr
    got, want = _everything(out), _everything(save)
    meta = "optimizer.param_to_group_meta.module.module."
    assert sorted(set(got) - set(want)) == sorted(k for k in got if k.startswith(meta) and k.endswith(".step"))
    assert len(set(got) - set(want)) == params and all(got[k] == 1.0 for k in set(got) - set(want))
    assert sorted(set(want) - set(got)) == ["num_floating_point_operations_so_far", *sorted(
        f"opt_param_scheduler.{k}" for k in megatron_fsdp_dtensor.SCHEDULER), "rng_state.(0, 0)"]
    assert [k for k in want if k in got and not _same(got[k], want[k])] == []
    return got, want


@needs("0.19")
def test_a_torch_dist_checkpoint_converted_to_megatron_fsdp_is_what_megatron_fsdp_saves_of_its_state(
        saved, rebuilt, fsdp_dtensor, tmp_path):
    """torch_dist (layer stacks, fc1 as [W_all; V_all], fully_reshardable) as Megatron-FSDP's
    fsdp_dtensor at TP 2 × DP 2: every entry of Megatron-FSDP's save of the same run state
    (`fixtures.megatron_fsdp_dtensor`: names, fp32 masters as the model, moments and step per
    param, each param's group settings as megatron-core grouped it, args, counters) is there
    and equal; the source lacks the save's scheduler, flop count and RNG state, and the output
    also keeps each group's step (Transformer Engine's FusedAdam reads it there). Chunks are
    Megatron-FSDP's TP × DP boxes; converted from the dp_reshardable save (its buckets read in
    place) it is the same. Converted back to torch_dist it is the source again, and from
    the fsdp_dtensor save through torch_dist back to fsdp_dtensor, the scheduler and flop
    count come back too."""
    from torch.distributed.checkpoint import FileSystemReader

    out = tmp_path / "mfsdp"
    got, want = _converted_is_megatron_fsdps_save(rebuilt, fsdp_dtensor, out, 15, "--dp", "2")
    run = run_cli("reshard", saved[BUCKETS] / "dp_reshardable", tmp_path / "direct", "--layout", "megatron-fsdp",
                  "--dp", "2")  # read from the buckets in place: the same checkpoint
    assert run.returncode == 0, run.stderr
    run = run_cli("diff", tmp_path / "direct", out)
    assert (run.returncode, run.stdout) == (0, "68 tensors: 68 equal, 0 close, 0 differs; 288 bytes entries: "
                                               "288 equal, 0 differs\n")
    md = FileSystemReader(str(out)).read_metadata()
    chunks = md.state_dict_metadata["model.module.decoder.layers.0.mlp.linear_fc1.weight_w"].chunks
    assert [(list(c.offsets), list(c.sizes)) for c in chunks] == [([0, 0], [12, 32]), ([24, 0], [12, 32]),
                                                                   ([12, 0], [12, 32]), ([36, 0], [12, 32])]
    assert json.loads(run_cli("inspect", out, "--json").stdout)["format"] == "megatron-fsdp fsdp_dtensor"

    def bf16(state):
        state[0]["args"].bf16 = True
        return state

    half = _with_item(rebuilt, tmp_path / "bf16", "common_state/shard_0_1", bf16)  # Float16Module: a third module.
    run = run_cli("reshard", half, tmp_path / "mfsdp16", "--layout", "megatron-fsdp", "--dp", "2")
    assert run.returncode == 0, run.stderr
    got16 = _everything(tmp_path / "mfsdp16")
    assert {k.replace(".module.module.module.", ".module.module.") for k in got16 if k.startswith("optimizer.")} == \
        {k for k in got if k.startswith("optimizer.")}
    assert all(got16[k].dtype == torch.float32 for k in got16 if k.startswith("model."))  # the fp32 masters
    run = run_cli("reshard", out, tmp_path / "back", "--layout", "torch-dist")
    assert run.returncode == 0, run.stderr
    back, source = _load(tmp_path / "back"), _load(rebuilt)
    assert sorted(back) == sorted(source) and all(torch.equal(back[k], source[k]) for k in source)
    run = run_cli("reshard", fsdp_dtensor, tmp_path / "td", "--layout", "torch-dist")
    assert run.returncode == 0, run.stderr
    run = run_cli("reshard", tmp_path / "td", tmp_path / "again", "--layout", "megatron-fsdp", "--tp", "1", "--dp", "2")
    assert run.returncode == 0, run.stderr
    again = _everything(tmp_path / "again")
    assert sorted(set(want) - set(again)) == ["rng_state.(0, 0)"]
    assert [k for k in want if k in again and k != "args" and not _same(again[k], want[k])] == []
    assert vars(again["args"]) == {**vars(want["args"]), "tensor_model_parallel_size": 1, "world_size": 2,
                                   "expert_tensor_parallel_size": 1}


@needs("0.19")
def test_args_of_the_wrong_kind_are_one_line_each(rebuilt, tmp_path):
    """Values in a checkpoint's args are input like any other: one of the wrong type is named in
    one line, exit 2, nothing written."""
    cases = [("swiglu", "yes", (), "args.swiglu is 'yes': whether fc1 is gated (saved split into weight_w / "
                                    "weight_v) is not known"),
             ("tensor_model_parallel_size", "x", (), "args.tensor_model_parallel_size is 'x', not a TP size; pass --tp"),
             ("make_vocab_size_divisible_by", "128", ("--tp", "1"),
              "args.make_vocab_size_divisible_by is '128', not a row count")]
    for i, (name, value, grid, line) in enumerate(cases):

        def changed(state, name=name, value=value):
            setattr(state[0]["args"], name, value)
            return state

        src = _with_item(rebuilt, tmp_path / f"src{i}", "common_state/shard_0_1", changed)
        run = run_cli("reshard", src, tmp_path / "o", "--layout", "megatron-fsdp", "--dp", "1", *grid)
        assert (run.returncode, run.stderr) == (2, f"ckptctl: error: {src}: {line}\n"), name
        assert not (tmp_path / "o").exists()


@needs("0.19")
@pytest.mark.full  # the TP 2 × PP 2 training above; `test_pipeline_layouts_are_read_as_megatron_core_reads_them` in make test
def test_pipeline_splits_args_do_not_prove_are_refused_naming_why(saved, tmp_path):
    """Stages are rebuilt for layers split as args say (evenly, or by stage sizes), with args
    that say whether the embedding is tied (then the last stage holds a copy of it), and as many
    DP groups as args' TP × PP say; anything else in args, or a split the saved buckets disagree
    with, is one line, exit 2, nothing written."""
    where = "common_state/shard_0_1"
    split = "2 layers cannot be split over 2 pipeline stages"
    cases = [("untie_embeddings_and_output_weights", None, f"{where}: args.untie_embeddings_and_output_weights is "
              "None: whether the last pipeline stage holds a copy of the embedding is not known"),
             ("pipeline_model_parallel_layout", "Et|tmL", f"{split} as args say: multi-token prediction layers "
              "(m) in a custom layout are not rebuilt"),
             ("pipeline_model_parallel_layout", "Et|tx", f"{where}: args.pipeline_model_parallel_layout 'Et|tx': "
              "letters 'x' are not layers (E, L, t, m)"),
             ("pipeline_model_parallel_layout", ["Et", "tL"], f"{where}: args.pipeline_model_parallel_layout is "
              "['Et', 'tL'], not a string"),
             ("pipeline_model_parallel_layout", "Ettt|L", f"{split} as args say: the layout holds 3 layers"),
             ("decoder_first_pipeline_num_layers", "1", f"{where}: args.decoder_first_pipeline_num_layers is '1'"),
             ("account_for_loss_in_pipeline_split", 1, f"{where}: args.account_for_loss_in_pipeline_split is 1"),
             ("pipeline_model_parallel_size", "2", f"{where}: args.pipeline_model_parallel_size is '2'"),
             ("num_layers_per_virtual_pipeline_stage", 3, f"{where}: args.num_layers_per_virtual_pipeline_stage is "
              "3, but args.num_layers is 2 at PP 2 × VPP 1"),
             ("num_virtual_stages_per_pipeline_rank", 2, f"{where}: args.num_virtual_stages_per_pipeline_rank is 2, "
              "but args.virtual_pipeline_model_parallel_size is 1"),
             ("virtual_pipeline_model_parallel_size", 3, f"{split} × 3 model chunks as args say: stages of [1, 1] "
              "layers do not divide into 3 model chunks"),
             ("pipeline_model_parallel_size", 4, "2 layers cannot be split over 4 pipeline stages as args say: "
              "2 layers do not divide over 4 pipeline stages"),
             ("account_for_embedding_in_pipeline_split", True, f"{split} as args say: 3 layers do not divide over "
              "2 pipeline stages"),
             ("decoder_last_pipeline_num_layers", 3, f"{split} as args say: -1 layers left over for 1 middle stages"),
             ("decoder_first_pipeline_num_layers", 2, "dp_group_idx_0: 6 params (decoder.layers.mlp.linear_fc2.weight[1] "
              "first) are in no bucket: another model spec or megatron-core version"),
             ("pipeline_model_parallel_size", 1, "dp_group_idx_<g>: groups [0, 1, 2, 3], "
              "expected one per TP rank 0…1")]
    for i, (name, value, line) in enumerate(cases):

        def changed(state, name=name, value=value):
            setattr(state[0]["args"], name, value)
            return state

        src = _with_item(saved[PIPELINE] / "dp_reshardable", tmp_path / f"src{i}", where, changed)
        run = run_cli("reshard", src, tmp_path / "o")
        assert (run.returncode, run.stderr) == (2, f"ckptctl: error: {src}: {line}\n"), name
        assert not (tmp_path / "o").exists()

    def other_lr(value):  # the last stage's optimizer with other settings than the first's
        value[0]["param_groups"][0]["lr"] = 0.5
        return value

    item = "optimizer.distributed.dp_group_idx_3.optimizer"
    src = _with_item(saved[PIPELINE] / "dp_reshardable", tmp_path / "lr", f"{item}/shard_0_1", other_lr)
    run = run_cli("reshard", src, tmp_path / "o")
    assert (run.returncode, run.stderr) == (2, f"ckptctl: error: {src}: {item}: the DP groups of one optimizer "
                                               "saved different param groups\n")


@pytest.mark.full
def test_a_moe_converted_to_megatron_fsdp_is_what_megatron_fsdp_saves_of_its_state(saved, tmp_path):
    """Qwen3-MoE at TP 2 (q/k norms, a router, SequentialMLP experts stacked [L, E, …] in torch_dist):
    each expert's params by their module names, in the groups megatron-core gave them (with the
    dense params: no expert parallelism)."""
    from fixtures import megatron_fsdp_dtensor

    rewrite, save = tmp_path / "rewrite", tmp_path / "save"
    run = run_cli("reshard", saved[MOE] / "dp_reshardable", rewrite)
    assert run.returncode == 0, run.stderr
    megatron_fsdp_dtensor.write(rewrite, saved[MOE] / "buffers.json", save, 2, 1)
    _converted_is_megatron_fsdps_save(rewrite, save, tmp_path / "o", 33, "--dp", "1")
    _converted_is_megatron_fsdps_save(saved[MOE] / "dp_reshardable", save, tmp_path / "direct", 33, "--dp", "1")


@needs("0.19")
@pytest.mark.full
def test_a_deepseek_converted_to_megatron_fsdp_is_what_megatron_fsdp_saves_and_converts_back(saved, tmp_path):
    """DeepSeek-V3 at TP 2 (local spec: MLA's projections and norms keep their module names,
    per-layer keys, a shared expert): each param as Megatron-FSDP names and groups it, and the
    router's expert bias, a buffer, as the whole plain tensor Megatron-FSDP's save holds, with no
    optimizer state; from the buckets in place too. Converted back to torch_dist it is the
    rewrite again, tensor for tensor."""
    from fixtures import megatron_fsdp_dtensor

    rewrite, save = tmp_path / "rewrite", tmp_path / "save"
    run = run_cli("reshard", saved[DEEPSEEK] / "dp_reshardable", rewrite)
    assert run.returncode == 0, run.stderr
    megatron_fsdp_dtensor.write(rewrite, saved[DEEPSEEK] / "buffers.json", save, 2, 1)
    got, want = _converted_is_megatron_fsdps_save(rewrite, save, tmp_path / "o", 34, "--dp", "1")
    bias = "model.module.decoder.layers.1.mlp.router.expert_bias"
    assert torch.equal(got[bias], _load(rewrite)["decoder.layers.1.mlp.router.expert_bias"])
    assert not [k for k in got if k.startswith("optimizer.") and "expert_bias" in k]
    _converted_is_megatron_fsdps_save(saved[DEEPSEEK] / "dp_reshardable", save, tmp_path / "direct", 34, "--dp", "1")
    run = run_cli("reshard", tmp_path / "o", tmp_path / "back", "--layout", "torch-dist", "--world-size", "2")
    assert run.returncode == 0, run.stderr
    back, source = _load(tmp_path / "back"), _load(rewrite)
    assert sorted(back) == sorted(source) and all(torch.equal(back[k], source[k]) for k in source)


@needs("0.19")
def test_a_torch_dist_checkpoint_is_converted_to_megatron_fsdp_only_when_its_groups_are_known(saved, rebuilt,
                                                                                              tmp_path):
    """Which group each param was in is not saved in torch_dist: it is derived by megatron-core's
    standard rule and checked against the saved groups (one line, nothing written, when they do
    not match); megatron-core 0.15's model-space fragments are rewritten first; a TP that does
    not divide the query groups, or at which Megatron pads the vocab otherwise, is refused."""
    run = run_cli("reshard", FS_MODEL_SPACE, tmp_path / "o", "--layout", "megatron-fsdp", "--dp", "2")
    assert (run.returncode, run.stderr) == (2, f"ckptctl: error: {FS_MODEL_SPACE}: its optimizer state is "
                                               "fully_sharded_model_space: rewrite it as fully_reshardable first "
                                               "(ckptctl reshard SRC MID), then convert MID\n")

    def same_decay(state):
        for group in state[0]["optimizer"]["optimizer"]["param_groups"]:
            group["wd_mult"] = 1.0
        return state

    odd = _with_item(rebuilt, tmp_path / "odd", "common_state/shard_0_1", same_decay)
    run = run_cli("reshard", odd, tmp_path / "o", "--layout", "megatron-fsdp", "--dp", "2")
    assert (run.returncode, run.stderr) == (2, f"ckptctl: error: {odd}: decoder.layers.0.self_attention.linear_proj.weight: "
                                               "megatron-core's standard rule puts it in a group of wd_mult 1.0, "
                                               "is_expert_parallel False; 2 of the 2 saved groups are such (trained "
                                               "with other overrides?)\n")
    run = run_cli("reshard", rebuilt, tmp_path / "o", "--layout", "megatron-fsdp", "--tp", "4", "--dp", "1")
    assert (run.returncode, run.stderr) == (2, "ckptctl: error: TP 4 does not divide the 2 query groups of args\n")

    def small_vocab(state):
        state[0]["args"].vocab_size = 100
        return state

    run = run_cli("reshard", _with_item(rebuilt, tmp_path / "v", "common_state/shard_0_1", small_vocab), tmp_path / "o",
                  "--layout", "megatron-fsdp", "--tp", "1", "--dp", "1")
    assert (run.returncode, run.stderr) == (2, "ckptctl: error: at TP 1 Megatron pads the vocab of 100 to 128 rows, "
                                               "not the saved 256: re-padding the vocab is not done yet\n")
    run = run_cli("reshard", rebuilt, tmp_path / "o", "--layout", "megatron-fsdp", "--dp", "2", "--split-fused")
    assert (run.returncode, run.stderr) == (2, "ckptctl: error: a torch_dist checkpoint converted to Megatron-FSDP's "
                                               "fsdp_dtensor takes --tp, --dp and --world-size only (fc1 is split "
                                               "as Megatron-LM saves it)\n")
    assert not (tmp_path / "o").exists()


@needs("0.19")
@pytest.mark.full
def test_megatron_core_pads_the_vocab_of_a_rewrite_loaded_at_another_padded_size_itself(rebuilt, tmp_path):
    """Megatron pads the vocab to a multiple of `make_vocab_size_divisible_by` × TP, so a job at
    another TP may have more (or fewer) vocab rows than the checkpoint: megatron-core's own load
    pads with zero rows (or cuts) the embedding, the output layer and their fully_reshardable
    optimizer states itself (`allow_shape_mismatch`). The rewrite needs no re-padding: loaded
    into 288 rows, the output layer is the saved one followed by zero rows, and it trains on."""
    from fixtures import megatron_optim

    got = megatron_optim.load(rebuilt, 1, 2, tmp_path / "loss.pt", mcore="0.19", padded_vocab=288)
    saved_rows = _load(rebuilt)["output_layer.weight"]
    assert got["output_layer"].shape == (288, 32) and torch.equal(got["output_layer"][:256], saved_rows)
    assert not got["output_layer"][256:].any() and got["after_step"] < got["step"]


@pytest.mark.full
def test_a_moe_rewrite_resumes_at_another_tp_with_the_saved_runs_loss(saved, tmp_path):
    from fixtures import megatron_optim

    out = tmp_path / "o"
    run = run_cli("reshard", saved[MOE] / "dp_reshardable", out, "--verify")
    assert run.returncode == 0, run.stderr
    want = torch.load(saved[MOE] / "loss.pt")
    got = megatron_optim.load(out, 1, 2, tmp_path / "loss.pt", kind="qwen3-moe")
    assert (got["step"], got["after_step"]) == (want["step2"], want["after_step2"])


@needs("0.19")
@pytest.mark.full
def test_a_deepseek_rewrite_resumes_with_the_saved_runs_loss(saved, tmp_path):
    """Per-layer keys, MLA, a shared expert and the expert bias: every rebuilt param state is its
    weight, and megatron-core's own load of the output resumes the saved run bit for bit at its TP,
    and at TP 1 × DP 2 (which the bucketed source cannot load at) takes the same step. (Its loss
    after that step differs in the 7th digit there: MLA's TP-split down projections sum their
    input gradients in another order at TP 1.)"""
    from fixtures import megatron_optim

    out = tmp_path / "o"
    run = run_cli("reshard", saved[DEEPSEEK] / "dp_reshardable", out, "--verify")
    assert run.returncode == 0, run.stderr
    got = _load(out)
    params = {k: v for k, v in got.items() if k.startswith("optimizer.state.param.")}
    assert len(params) == 28 and "optimizer.state.param.decoder.layers.1.mlp.router.expert_bias" not in got
    for key, value in params.items():
        assert torch.equal(value, got[key[len("optimizer.state.param."):]]), key
    want = torch.load(saved[DEEPSEEK] / "loss.pt")
    same_tp = megatron_optim.load(out, 2, 1, tmp_path / "tp2.pt", kind="deepseek-v3", mcore="0.19")
    assert (same_tp["sharding_type"], same_tp["step"], same_tp["after_step"]) == (
        "fully_reshardable", want["step2"], want["after_step2"])
    other_tp = megatron_optim.load(out, 1, 2, tmp_path / "tp1.pt", kind="deepseek-v3", mcore="0.19")
    assert other_tp["step"] == want["step2"]
    assert other_tp["after_step"] == pytest.approx(want["after_step2"], rel=1e-6)


@needs("0.19")
@pytest.mark.full
def test_a_deepseek_rewrite_with_a_multi_token_prediction_layer_resumes_with_the_saved_runs_loss(saved, tmp_path):
    """An MTP layer (its norms, projection, transformer layer and final norm, after the decoder's
    final norm in registration order), trained with its loss: every rebuilt param state is its
    weight, and megatron-core resumes the rewrite bit for bit. Under pipeline parallelism with a
    tied embedding (which megatron-core cannot save) it is refused by name."""
    from fixtures import megatron_optim

    case = (*DEEPSEEK, ("mtp", 1))
    out = tmp_path / "o"
    run = run_cli("reshard", saved[case] / "dp_reshardable", out, "--verify")
    assert run.returncode == 0, run.stderr
    got = _load(out)
    params = {k: v for k, v in got.items() if k.startswith("optimizer.state.param.")}
    assert len(params) == 46 and sum(k.startswith("optimizer.state.param.mtp.layers.0.") for k in params) == 18
    for key, value in params.items():
        assert torch.equal(value, got[key[len("optimizer.state.param."):]]), key
    want = torch.load(saved[case] / "loss.pt")
    resumed = megatron_optim.load(out, 2, 1, tmp_path / "loss.pt", kind="deepseek-v3", mcore="0.19", mtp=1)
    assert (resumed["sharding_type"], resumed["step"], resumed["after_step"]) == (
        "fully_reshardable", want["step2"], want["after_step2"])

    def pipelined_and_tied(state):
        state[0]["args"].pipeline_model_parallel_size = 2
        state[0]["args"].untie_embeddings_and_output_weights = False
        return state

    src = _with_item(saved[case] / "dp_reshardable", tmp_path / "pp2", "common_state/shard_0_1", pipelined_and_tied)
    run = run_cli("reshard", src, tmp_path / "o2")
    assert (run.returncode, run.stderr) == (2, f"ckptctl: error: {src}: mtp.layers.0.eh_proj.weight: multi-token "
                                               "prediction layers under pipeline parallelism with a tied embedding "
                                               "are not rebuilt (megatron-core cannot save them)\n")


@pytest.mark.full
@pytest.mark.parametrize("case", [("llama", 2, 2, 0), pytest.param(("llama", 2, 2, 0, "0.19"), marks=needs("0.19")),
                                  MOE], ids=case_id)
def test_with_one_bucket_the_rewrite_equals_megatron_cores_own_fully_reshardable_save(saved, tmp_path, case):
    ckpt = saved[case]
    run = run_cli("reshard", ckpt / "dp_reshardable", tmp_path / "o", "--verify")
    assert run.returncode == 0, run.stderr
    got, want = _load(tmp_path / "o"), _load(ckpt / "fully_reshardable")
    assert sorted(got) == sorted(want)
    assert all(torch.equal(got[k], want[k]) for k in want)


@needs("0.19")
def test_another_spec_order_is_refused(saved, monkeypatch):
    """fc1 and fc2 swapped in the registration order: every bucket's length still adds up, but a
    saved chunk crosses a param boundary of that order."""
    from ckptctl.megatron import buckets
    from ckptctl.util.errors import CheckpointError
    from ckptctl.formats.dcp.metadata import open_checkpoint

    layer = dict(buckets.LOCAL_SPEC)["decoder.layers."]
    names = [name for name, _ in layer]
    fc1, fc2 = names.index("mlp.linear_fc1.weight"), names.index("mlp.linear_fc2.weight")
    swapped = list(layer)
    swapped[fc1], swapped[fc2] = layer[fc2], layer[fc1]
    swapped = tuple(swapped)
    monkeypatch.setattr(buckets, "LOCAL_SPEC", tuple((n, swapped if n == "decoder.layers." else k)
                                                for n, k in buckets.LOCAL_SPEC))
    ckpt = open_checkpoint(saved[BUCKETS] / "dp_reshardable")
    model = {k for k in ckpt.tensors if not k.startswith("optimizer.")}
    with pytest.raises(CheckpointError, match=r"bucket_idx_1.param: the chunk \[1216, 2368\) crosses a parameter boundary of the "
                                              "layout rebuilt: another model spec or megatron-core version"):
        buckets.layout_buckets(ckpt, buckets.registration_order(ckpt, model), 2)


@needs("0.19")
@pytest.mark.parametrize("layout", ["fsdp2", "megatron-fsdp"])
def test_verify_refuses_params_of_one_size_laid_out_in_another_order(saved, tmp_path, monkeypatch, layout):
    """The two norms of a layer swapped in the local spec's table, and the table taken as the
    order (content not read): of one size, they swap places and every structural check passes,
    so the rewrite (torch_dist's own layout, or Megatron-FSDP's) runs; `--verify` finds a rebuilt
    master copy unequal to the weight saved beside it, and nothing is left at DST."""
    import ckptctl
    from ckptctl.megatron import buckets
    from ckptctl.planners import torch_dist
    from ckptctl.util.errors import CheckpointError

    monkeypatch.setattr(torch_dist, "content_order", lambda ckpt, read: buckets.table_order)

    layer = dict(buckets.LOCAL_SPEC)["decoder.layers."]
    names = [name for name, _ in layer]
    attn, mlp = (names.index(f"{n}.layer_norm_weight") for n in ("self_attention.linear_qkv", "mlp.linear_fc1"))
    swapped = list(layer)
    swapped[attn], swapped[mlp] = layer[mlp], layer[attn]
    monkeypatch.setattr(buckets, "LOCAL_SPEC", tuple((n, tuple(swapped) if n == "decoder.layers." else k)
                                                for n, k in buckets.LOCAL_SPEC))
    src = saved[BUCKETS] / "dp_reshardable"
    opts = ckptctl.ReshardOptions(None) if layout == "fsdp2" else ckptctl.ReshardOptions(None, layout=layout, dp=2)
    ckptctl.reshard(src, tmp_path / "unverified", opts)
    with pytest.raises(CheckpointError) as err:
        ckptctl.reshard(src, tmp_path / "o", opts, verify=True)
    norm = r"decoder\.layers\.(self_attention\.linear_qkv|mlp\.linear_fc1)\.layer_norm_weight"
    master, param = (rf"optimizer\.state\.param\.{norm}", norm) if layout == "fsdp2" else \
        (r"model\.module\.decoder\.layers\.[01]\.(input|pre_mlp)_layernorm\.weight", rf"{norm}\[[01]\]")
    assert re.fullmatch(rf"{master}: verification failed \(the rebuilt master copy, cast to float32, is not its "
                        rf"param {param}: the source's optimizer state was not laid out as rebuilt\)",
                        err.value.reason), err.value.reason
    assert not (tmp_path / "o").exists()


class Built:
    """A class whose pickle sets state (NEWOBJ + BUILD)."""

    def __init__(self) -> None:
        self.x = 1


class AttnBackend(enum.Enum):
    """Stands in for megatron-core 0.19's enum in `args` (`attention_backend`)."""

    local = 2


def test_args_holding_unknown_classes_are_read_as_inert_names(tmp_path):
    """An enum member in args (megatron-core 0.19) is kept as its name and value, never built; a
    pickle that sets state on such a value is a problem line, not a crash."""
    import shutil

    from ckptctl.formats.dcp.metadata import open_checkpoint
    from ckptctl.formats.megatron_args import Opaque, training_args

    src = tmp_path / "src"
    shutil.copytree(ROOT / "fixtures" / "data" / "megatron_torch_dist", src)
    torch.save({"args": argparse.Namespace(tensor_model_parallel_size=2, attention_backend=AttnBackend.local)},
               src / "common.pt")
    found = training_args(open_checkpoint(src))
    assert (found.where, found.problem, found.get("tensor_model_parallel_size")) == ("common.pt", None, 2)
    assert found.get("attention_backend") == Opaque(__name__, "AttnBackend", (2,))
    doc = json.loads(run_cli("inspect", src, "--json").stdout)
    assert doc["training"] == {"from": "common.pt", "tp": 2, "pp": None, "vpp": None, "dp": None, "ep": None,
                               "etp": None, "cp": None, "iteration": None, "first_stage_layers": None,
                               "last_stage_layers": None, "optimizer_instances": None, "pipeline_layout": None,
                               "problem": None}
    data = pickle.dumps({"args": Built()}, protocol=2)  # NEWOBJ + BUILD of an unknown class: refused
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_STORED) as archive:
        archive.writestr("common/data.pkl", data)
    (src / "common.pt").write_bytes(buf.getvalue())
    doc = json.loads(run_cli("inspect", src, "--json").stdout)
    assert doc["training"]["problem"].startswith("not decoded without running code (")


def _fs_model_space_rewrite(out):
    run = run_cli("reshard", FS_MODEL_SPACE, out, "--verify")
    assert run.returncode == 0, run.stderr
    return out


def test_a_fully_sharded_model_space_state_newer_megatron_core_refuses_is_rebuilt_in_model_space(tmp_path):
    """megatron-core 0.15.3's `fully_sharded_model_space` save (the committed fixture: TP 2 × DP 2,
    seven buckets, its `.metadata` an `MCoreMetadata`), which 0.16 cannot load: inspect reads
    it, and reshard rebuilds each param's fragments in its shape (the `param` states are the
    weights; every state is cut by the same fragment geometry)."""
    doc = json.loads(run_cli("inspect", FS_MODEL_SPACE, "--json").stdout)
    assert doc["optimizer_format"] == "fully_sharded_model_space" and not doc["problems"]
    assert doc["megatron_core"] == {"versions": "0.15 or older", "evidence": "MCoreMetadata in .metadata"}
    assert doc["tensors"]["optimizer.state.exp_avg.decoder.layers.mlp.linear_fc1.weight"]["layout"] == "model-space"
    got = _load(_fs_model_space_rewrite(tmp_path / "o"))
    assert not any(".fp32_param." in k for k in got)
    for key in (k for k in got if k.startswith("optimizer.state.param.")):
        assert torch.equal(got[key], got[key[len("optimizer.state.param."):]]), key


@pytest.mark.full
def test_the_rebuilt_fully_sharded_model_space_state_resumes_with_the_saved_runs_loss(tmp_path):
    """megatron-core 0.16.1 resumes the rewrite at TP 1 × DP 2 with the loss of the run that saved it."""
    from fixtures import megatron_optim

    out = _fs_model_space_rewrite(tmp_path / "o")
    want = json.loads(FS_MODEL_SPACE.with_name(FS_MODEL_SPACE.name + ".loss.json").read_text())
    resumed = megatron_optim.load(out, 1, 2, tmp_path / "loss.pt")
    assert (resumed["step"], resumed["after_step"]) == (want["step2"], want["after_step2"])


@needs("0.15")
@pytest.mark.full
def test_with_one_bucket_fragments_rebuild_megatron_core_0_15s_own_fully_reshardable_save(saved, tmp_path):
    ckpt = saved[("llama", 2, 2, 0, "0.15")]
    run = run_cli("reshard", ckpt / "fully_sharded_model_space", tmp_path / "o", "--verify")
    assert run.returncode == 0, run.stderr
    got, want = _load(tmp_path / "o"), _load(ckpt / "fully_reshardable")
    assert sorted(got) == sorted(want)
    assert all(torch.equal(got[k], want[k]) for k in want)


def test_a_state_that_is_not_fragments_of_its_param_is_refused_naming_both_shapes():
    """Fragment counts that do not divide the param, or a fragment of another size: refused."""
    import dataclasses

    from ckptctl.util.errors import CheckpointError
    from ckptctl.formats.dcp.metadata import open_checkpoint
    from ckptctl.megatron.fragments import fragment_targets

    ckpt = open_checkpoint(FS_MODEL_SPACE)
    key = "optimizer.state.exp_avg.decoder.layers.self_attention.linear_qkv.weight"
    assert ckpt.tensors[key].shape == (2, 2, 1, 1024)
    ckpt.tensors[key] = dataclasses.replace(ckpt.tensors[key], shape=(2, 4, 1, 512))
    fragment_targets(ckpt)  # four row blocks of 16 rows × 32: fragments too
    ckpt.tensors[key] = dataclasses.replace(ckpt.tensors[key], shape=(2, 3, 1, 1024))
    with pytest.raises(CheckpointError, match=re.escape(f"{key}: [2, 3, 1, 1024] is not fragments of its param "
                                                        "[2, 64, 32] (each dim's fragment count, then one "
                                                        "fragment's elements)")):
        fragment_targets(ckpt)


def _rng_load(path, states: dict[str, int]) -> dict[str, list]:
    """Megatron-LM's fsdp_dtensor load of the RNG state (`load_checkpoint`: `get_rng_state`'s
    `{'(pp, tp)': list of the job's DP states}` loaded by DCP with its default partial load), in
    one process: for each (pp, tp) key, the job's DP size; each state the checkpoint lacks keeps
    the job's own (here `None` markers: `fresh`)."""
    import random

    from torch.distributed.checkpoint import load
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    sd = {"rng_state": {key: [{"random_rng_state": ("fresh",), "torch_rng_state": torch.zeros(5056, dtype=torch.uint8)}
                              for _ in range(dp)] for key, dp in states.items()}}
    load(sd, checkpoint_id=str(path), planner=DefaultLoadPlanner(allow_partial_load=True), no_dist=True)
    seeds = {random.Random(1234 + 10 * d).getstate(): d for d in range(8)}
    return {key: [seeds.get(s["random_rng_state"], "fresh") for s in dp_states]
            for key, dp_states in sd["rng_state"].items()}


@needs("0.19")
@pytest.mark.full
def test_megatron_fsdps_per_dp_rng_state_is_named_and_follows_a_dp_change_only_as_asked(saved, rebuilt, tmp_path):
    """Megatron-FSDP's save at TP 2 × DP 2 with `--data-parallel-random-init` (`fixtures.megatron_fsdp_dtensor`:
    each (pp, tp) rank's list of its DP ranks' RNG states, `rng_state.(0, <tp>).<dp>.*`): inspect
    names it with what Megatron-LM's loader does; a reshard to another DP refuses by default; dropped
    with `--exclude` the output has none; with `--keep-common-ranks` a DP 1 job resumes DP rank 0's
    state and a DP 4 job ranks 0 and 1's, the others their own fresh state (DCP's partial load,
    as Megatron-LM loads fsdp_dtensor); at the same DP every state is kept."""
    from fixtures import megatron_fsdp_dtensor

    src = tmp_path / "src"
    megatron_fsdp_dtensor.write(rebuilt, saved[BUCKETS] / "buffers.json", src, 2, 2, data_parallel_random_init=True)
    entries = [f"rng_state.(0, {tp}).{dp}.{field}" for tp in (0, 1) for dp in (0, 1)
               for field in ("random_rng_state", "torch_rng_state")]
    loader = ("one state per DP rank of 2 (--data-parallel-random-init): DP rank i resumes state i, at a larger DP "
              "ranks ≥ 2 start afresh (partial load; --strict-fsdp-dtensor-load fails); at a (pp, tp) not saved "
              "Megatron-LM's partial load leaves the job's fresh state")
    assert json.loads(run_cli("inspect", src, "--json").stdout)["rank_state"] == [
        {"kind": "Megatron's RNG state", "entries": entries, "dp": 2, "grid": [[0, 0], [0, 1]], "loader": loader}]
    assert f"Per-rank state rng_state.(0, 0).0.random_rng_state … rng_state.(0, 1).1.torch_rng_state: Megatron's " \
           f"RNG state of (PP, TP) ranks (0, 0), (0, 1), {loader}" in " ".join(run_cli("inspect", src).stdout.split())
    assert _rng_load(src, {"(0, 0)": 2, "(0, 1)": 2}) == {"(0, 0)": [0, 1], "(0, 1)": [0, 1]}  # as saved

    refused = run_cli("reshard", src, tmp_path / "dp4", "--layout", "megatron-fsdp", "--tp", "1", "--dp", "4")
    assert (refused.returncode, refused.stderr) == (2, (
        "ckptctl: error: rng_state.(pp, tp).{0..1}.* of 2 (PP, TP) ranks: Megatron's RNG state of DP 2 (one state "
        "per DP rank, --data-parallel-random-init) cannot follow a reshard to DP 4 (DP rank i resumes state i); pass "
        "--exclude 'rng_state.*' to drop it (every rank starts afresh) or --keep-common-ranks to keep the states of "
        "the DP ranks both sizes have\n"))
    assert not (tmp_path / "dp4").exists()

    run = run_cli("reshard", src, tmp_path / "dropped", "--layout", "megatron-fsdp", "--tp", "1", "--dp", "4",
                  "--exclude", "rng_state.*")
    assert run.returncode == 0, run.stderr
    assert json.loads(run_cli("inspect", tmp_path / "dropped", "--json").stdout)["rank_state"] == []
    assert _rng_load(tmp_path / "dropped", {"(0, 0)": 4}) == {"(0, 0)": ["fresh"] * 4}

    run = run_cli("reshard", src, tmp_path / "dp1", "--layout", "megatron-fsdp", "--tp", "1", "--dp", "1",
                  "--keep-common-ranks", "--verify")
    assert run.returncode == 0, run.stderr
    assert json.loads(run_cli("inspect", tmp_path / "dp1", "--json").stdout)["rank_state"][0]["entries"] == \
        [e for e in entries if ").0." in e]
    assert _rng_load(tmp_path / "dp1", {"(0, 0)": 1}) == {"(0, 0)": [0]}
    run = run_cli("reshard", src, tmp_path / "dp4", "--layout", "megatron-fsdp", "--tp", "1", "--dp", "4",
                  "--keep-common-ranks")
    assert run.returncode == 0, run.stderr
    assert _rng_load(tmp_path / "dp4", {"(0, 0)": 4}) == {"(0, 0)": [0, 1, "fresh", "fresh"]}
    run = run_cli("reshard", src, tmp_path / "dp2", "--layout", "megatron-fsdp", "--tp", "1", "--dp", "2")
    assert run.returncode == 0, run.stderr
    assert json.loads(run_cli("inspect", tmp_path / "dp2", "--json").stdout)["rank_state"][0]["entries"] == entries
    assert _rng_load(tmp_path / "dp2", {"(0, 0)": 2}) == {"(0, 0)": [0, 1]}
