"""`ckptctl export-hf` end to end: real multi-process checkpoints in, transformers loads the output.

Tiny random `transformers` models (fp32) are converted to the Megatron layout test-side
(`fixtures.hf_models`), saved by real gloo ranks as Megatron-FSDP would (uneven TP×DP
row boxes, padded vocab, `_extra_state`, optimizer, rng and `args` entries), exported by
the CLI, loaded back with `AutoModelForCausalLM.from_pretrained` and compared bit for bit
with the original model, logits included. Every checkpoint the selected tests need is
written by one spawn of ranks per session.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from fixtures import hf_models
from fixtures.gloo import run_ranks
from tests.conftest import run_cli

WORLD = 2


@dataclass(frozen=True)
class Case:
    """One Megatron checkpoint: family, training TP, fc1 and GDN storage, key prefix."""

    family: str
    tp: int
    fc1: str = "fused"
    gdn: str = "fused"
    prefix: str = "module."

    @property
    def id(self) -> str:
        gdn = f"-gdn_{self.gdn}" if self.family in hf_models.GATED_ATTENTION else ""
        return f"{self.family}-tp{self.tp}-fc1_{self.fc1}{gdn}"


DEFAULT_CASES = [  # TP2 fused; prefixes varied (split, TP4 and the newer families under make test-full: their
    # import cases and the Bridge oracle export them back bit for bit)
    Case("llama", 2, "fused"),
    Case("qwen3", 2, "fused", prefix=""),
    Case("qwen3-moe", 2, "fused", prefix="module.module."),
    Case("qwen3-next", 2, "fused", "fused"),
]
ALL_CASES = [Case(f, tp, fc1, gdn) for f in hf_models.FAMILIES for tp in (1, 2, 4) if tp <= hf_models.MAX_TP[f]
             for fc1 in (("fused",) if f in (*hf_models.GEGLU, "nemotron-h") else ("fused", "split"))
             for gdn in (("fused", "split") if f in hf_models.GATED_ATTENTION else ("fused",))]
FULL_CASES = [c for c in ALL_CASES if c.id not in {d.id for d in DEFAULT_CASES}]
SPECIAL = ("no-tp-source", "tp-disagrees", "fsdp2-raw")


@dataclass
class Saved:
    root: Path
    refs: dict[str, hf_models.Reference]
    ckpts: dict[str, Path]
    fsdp2_state: dict[str, torch.Tensor] | None


def needs(*what: str):
    """Mark a test as using special checkpoints (see SPECIAL), so the session fixture writes them."""
    def mark(fn):
        fn.needs = what
        return fn
    return mark


def _needed(session) -> tuple[list[Case], set[str]]:
    """The cases and special checkpoints of the selected tests of this module."""
    cases, special = {}, set()
    for item in session.items:
        if item.module is None or item.module.__name__ != __name__:
            continue
        params = getattr(getattr(item, "callspec", None), "params", {})
        if isinstance(params.get("case"), Case):
            cases[params["case"].id] = params["case"]
        special.update(s for s in getattr(item.function, "needs", ()))
    return list(cases.values()), special


@pytest.fixture(scope="session")
def saved(request, tmp_path_factory) -> Saved:
    """Every checkpoint the selected tests use, written by one spawn of `WORLD` gloo ranks."""
    root = tmp_path_factory.mktemp("export_hf")
    cases, special = _needed(request.session)
    families = {c.family for c in cases} | ({"llama"} if special - {"fsdp2-raw"} else set())
    refs = {f: hf_models.reference(f, root / f"ref_{f}") for f in sorted(families)}
    jobs, ckpts = [], {}
    for i, case in enumerate(cases):
        ckpts[case.id] = root / case.id
        state = hf_models.to_megatron(refs[case.family], case.tp, case.fc1, case.gdn)
        jobs.append(hf_models.MegatronJob(str(ckpts[case.id]), state, tp=case.tp, dp=3, seed=i, prefix=case.prefix))
    if "no-tp-source" in special:  # fused fc1, no args, no RowParallel weights to read TP from
        state = hf_models.to_megatron(refs["llama"], 2, "fused")
        keep = ("embedding.word_embeddings.weight", "decoder.layers.0.mlp.linear_fc1.weight")
        ckpts["no-tp-source"] = root / "no-tp-source"
        jobs.append(hf_models.MegatronJob(str(ckpts["no-tp-source"]), {k: state[k] for k in keep}, tp=2, dp=2,
                                          args_tp=None, extras=False))
    if "tp-disagrees" in special:  # trained at TP 4, args claim TP 2
        ckpts["tp-disagrees"] = root / "tp-disagrees"
        jobs.append(hf_models.MegatronJob(str(ckpts["tp-disagrees"]), hf_models.to_megatron(refs["llama"], 4),
                                          tp=4, dp=1, args_tp=2, extras=False))
    if "fsdp2-raw" in special:
        ckpts["fsdp2-raw"] = root / "fsdp2-raw"
        jobs.append(hf_models.Fsdp2Job(str(ckpts["fsdp2-raw"]), hf_models.fsdp2_llama_config()))
    results = run_ranks(hf_models.save_jobs, WORLD, hf_models.write_jobs(jobs, root / "jobs.pt"), timeout=900)
    fsdp2_state = results[0].get(str(ckpts["fsdp2-raw"])) if "fsdp2-raw" in special else None
    return Saved(root, refs, ckpts, fsdp2_state)


def export(saved: Saved, key: str, ref: Path, *extra: str) -> tuple[Path, dict]:
    dst = saved.root / "out" / f"{key}{'_'.join(extra).replace('-', '')}"
    res = run_cli("export-hf", saved.ckpts[key], dst, "--hf-config", ref, "--json", *extra)
    assert res.returncode == 0, res.stderr
    return dst, json.loads(res.stdout)


def read_safetensors(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out: dict[str, torch.Tensor] = {}
    for path in sorted(folder.glob("*.safetensors")):
        part = load_file(path)
        assert not set(part) & set(out), "a tensor is written twice"
        out.update(part)
    return out


def load_hf(folder: Path):
    from transformers import AutoModelForCausalLM

    model, info = AutoModelForCausalLM.from_pretrained(folder, output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    return model.eval()


def logits(model, vocab: int) -> torch.Tensor:
    ids = torch.randint(0, vocab, (2, 11), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        return model(input_ids=ids).logits


_REF_LOGITS: dict[str, torch.Tensor] = {}


def ref_logits(ref: hf_models.Reference) -> torch.Tensor:
    if ref.family not in _REF_LOGITS:
        _REF_LOGITS[ref.family] = logits(ref.model, ref.config.vocab_size)
    return _REF_LOGITS[ref.family]


def assert_same_model(dst: Path, ref: hf_models.Reference) -> None:
    got = read_safetensors(dst)
    assert sorted(got) == sorted(ref.state)
    for name, want in ref.state.items():
        assert got[name].dtype == want.dtype and torch.equal(got[name], want), name
    model = load_hf(dst)
    want_sd, got_sd = ref.model.state_dict(), model.state_dict()
    assert sorted(got_sd) == sorted(want_sd)
    for name, want in want_sd.items():
        assert torch.equal(got_sd[name], want), name
    assert (logits(model, ref.config.vocab_size) - ref_logits(ref)).abs().max() <= 1e-4
    config = json.loads((dst / "config.json").read_text())
    assert config["dtype"] == "float32" and config["model_type"] == ref.config.model_type
    for name in hf_models.TOKENIZER_FILES:
        assert (dst / name).read_bytes() == (ref.folder / name).read_bytes()


def run_case(saved: Saved, case: Case) -> None:
    ref = saved.refs[case.family]
    dst, summary = export(saved, case.id, ref.folder, "--verify")
    assert summary["verified"] and summary["arch"] == hf_models.ARCH[case.family]
    assert summary["tensors"] == len(ref.state)
    fused = case.fc1 == "fused" or (case.family in hf_models.GATED_ATTENTION and case.gdn == "fused")
    assert summary["tp"] == (case.tp if fused else None)  # the training TP is looked up only when needed
    assert_same_model(dst, ref)


@pytest.mark.parametrize("case", DEFAULT_CASES, ids=lambda c: c.id)
def test_export_round_trips_to_the_original_hf_model(saved, case):
    run_case(saved, case)


@pytest.mark.full
@pytest.mark.parametrize("case", FULL_CASES, ids=lambda c: c.id)
def test_export_round_trips_every_tp_and_layout(saved, case):
    run_case(saved, case)


@pytest.mark.parametrize("case", [Case("qwen3-moe", 2, "fused", prefix="module.module."),
                                  Case("qwen3-next", 2, "fused", "fused")], ids=lambda c: c.id)
def test_sharded_bf16_output_has_an_index_transformers_loads(saved, case):
    """Every tensor is the reference cast once to bf16 (GDN norm included), sharded, indexed, loadable."""
    ref = saved.refs[case.family]
    dst, summary = export(saved, case.id, ref.folder, "--max-shard-size", "10KB", "--dtype", "bf16")
    files = sorted(p.name for p in dst.glob("*.safetensors"))
    n = len(files)
    assert n > 1 and files == [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
    index = json.loads((dst / "model.safetensors.index.json").read_text())
    assert sorted(index["weight_map"]) == sorted(ref.state) and set(index["weight_map"].values()) == set(files)
    assert index["metadata"]["total_size"] == sum(t.numel() * 2 for t in ref.state.values())
    assert summary["files"] == len(files) and summary["bytes"] == sum((dst / f).stat().st_size for f in files)
    assert set(summary) >= {"tensors", "files", "bytes", "seconds", "gb_per_s", "peak_rss_bytes"}
    got = read_safetensors(dst)
    for name, want in ref.state.items():
        assert got[name].dtype == torch.bfloat16 and torch.equal(got[name], want.to(torch.bfloat16)), name
    assert json.loads((dst / "config.json").read_text())["dtype"] == "bfloat16" == summary["dtype"]
    model = load_hf(dst)
    assert model.dtype == torch.bfloat16
    for name, want in ref.model.state_dict().items():
        assert torch.equal(model.state_dict()[name], want.to(torch.bfloat16)), name


@needs("fsdp2-raw")
def test_raw_exports_an_fsdp2_checkpoint_with_hf_names(saved, tmp_path):
    from transformers import AutoConfig, AutoModelForCausalLM

    config = dict(hf_models.fsdp2_llama_config())
    hf_config = AutoConfig.for_model(config.pop("model_type"), **config)
    ref = tmp_path / "ref"
    hf_config.save_pretrained(ref)
    dst, summary = export(saved, "fsdp2-raw", ref, "--arch", "raw", "--verify")
    assert summary["arch"] == "raw" and summary["verified"]
    want = saved.fsdp2_state
    got = read_safetensors(dst)
    assert sorted(got) == sorted(set(want) - {"lm_head.weight"})  # tied: the embedding is written once
    model = load_hf(dst)
    for name, tensor in want.items():
        assert torch.equal(model.state_dict()[name], tensor), name
    trained = AutoModelForCausalLM.from_config(hf_config).eval()
    trained.load_state_dict(want)
    assert (logits(model, 100) - logits(trained, 100)).abs().max() <= 1e-4


def test_missing_config_is_refused_in_one_line(tmp_path):
    (tmp_path / "ref").mkdir()
    res = run_cli("export-hf", tmp_path / "nowhere", tmp_path / "dst", "--hf-config", tmp_path / "ref")
    assert res.returncode == 2
    assert res.stderr == (f"ckptctl: error: {tmp_path / 'ref'}: no config.json in this folder "
                          f"(--hf-config wants a Hugging Face model folder, its config.json, or a Hub model id)\n")
    assert not (tmp_path / "dst").exists()


@needs("no-tp-source")
def test_fused_fc1_without_a_tp_source_is_refused(saved, tmp_path):
    ckpt = saved.ckpts["no-tp-source"]
    res = run_cli("export-hf", ckpt, tmp_path / "dst", "--hf-config", saved.refs["llama"].folder)
    assert res.returncode == 2
    assert res.stderr == (f"ckptctl: error: {ckpt}: cannot tell the training TP size (no args entry, no RowParallel "
                          f"chunks split on dim 1); pass --tp\n")
    assert not (tmp_path / "dst").exists()


@needs("tp-disagrees")
def test_tp_disagreement_is_refused_and_tp_flag_settles_it(saved, tmp_path):
    ckpt, ref = saved.ckpts["tp-disagrees"], saved.refs["llama"]
    res = run_cli("export-hf", ckpt, tmp_path / "dst", "--hf-config", ref.folder)
    assert res.returncode == 2
    assert res.stderr == f"ckptctl: error: {ckpt}: args say TP 2 but RowParallel chunks show TP 4; pass --tp\n"
    res = run_cli("export-hf", ckpt, tmp_path / "dst", "--hf-config", ref.folder, "--tp", "4")
    assert res.returncode == 0, res.stderr
    assert_same_model(tmp_path / "dst", ref)


@pytest.mark.parametrize("case", [Case("llama", 2, "fused")], ids=lambda c: c.id)
def test_tp_flag_against_agreeing_args_and_geometry_is_refused(saved, case):
    from ckptctl.util.errors import UsageError
    from ckptctl.commands.export_hf import ExportOptions, plan_export
    from ckptctl.formats.dcp.metadata import open_checkpoint
    from ckptctl.families.base import load_hf_config

    ckpt = open_checkpoint(saved.ckpts[case.id])
    cfg = load_hf_config(saved.refs["llama"].folder)
    assert plan_export(ckpt, cfg, ExportOptions(tp=2)).tp == 2
    with pytest.raises(UsageError) as err:
        plan_export(ckpt, cfg, ExportOptions(tp=4))
    assert str(err.value) == (f"{ckpt.path}: --tp 4 but the checkpoint says TP 2 (args and RowParallel chunks); "
                              f"fused tensors would be split wrongly")


def test_verify_catches_one_flipped_bit_in_an_exported_tensor(fixture_ckpt, tmp_path):
    from ckptctl.engine.cpu import ChunkSource
    from ckptctl.util.errors import CheckpointError
    from ckptctl.commands.export_hf import ExportOptions, plan_export
    from ckptctl.formats.dcp.metadata import open_checkpoint
    from ckptctl.checks.verify import verify_safetensors_file
    from ckptctl.families.base import load_hf_config

    src = fixture_ckpt("fsdp2_4ranks")
    ref = tmp_path / "ref"
    ref.mkdir()
    (ref / "config.json").write_text(json.dumps({"model_type": "raw", "architectures": ["Sequential"]}))
    dst = tmp_path / "hf"
    assert run_cli("export-hf", src, dst, "--hf-config", ref, "--arch", "raw", "--no-name-check").returncode == 0
    ckpt = open_checkpoint(src)
    plan = plan_export(ckpt, load_hf_config(ref), ExportOptions(arch="raw", name_check=False))
    (file,) = plan.files
    name = "mlp.fc1.weight"  # [12, 8] fp32: flip the lowest bit of row 11's last element
    path = dst / file.name
    data = bytearray(path.read_bytes())
    data[file.offsets[name] + 12 * 8 * 4 - 4] ^= 1
    path.write_bytes(bytes(data))
    sources = ChunkSource(ckpt)
    try:
        with pytest.raises(CheckpointError) as err:
            verify_safetensors_file(path, file, plan.targets, plan.sources, sources, workers=2)
    finally:
        sources.close()
    assert str(err.value) == f"{path}: {name}: verification failed (rows from (0,) differ from the source)"


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_raw_export_of_multi_block_tensors_is_bit_exact(tmp_path):
    """Tensors of 12 MB are written in many 256 KB blocks, each file by its own worker."""
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import load_file

    gen = torch.Generator().manual_seed(1)
    weights = {f"layers.{i}.weight": torch.randn(1024, 3 * 1024, generator=gen) for i in range(2)}
    weights["layers.0.weight"][7, 11] = float("nan")  # copies keep every bit, NaN payloads included
    dcp.save({"model": dict(weights)}, checkpoint_id=tmp_path / "src", no_dist=True)
    ref = tmp_path / "ref"
    ref.mkdir()
    (ref / "config.json").write_text(json.dumps({"model_type": "raw"}))
    dst = tmp_path / "hf"
    result = run_cli("export-hf", tmp_path / "src", dst, "--hf-config", ref, "--arch", "raw", "--no-name-check",
                     "--max-shard-size", "13MB", "--verify")
    assert result.returncode == 0, result.stderr
    index = json.loads((dst / "model.safetensors.index.json").read_text())
    assert sorted(set(index["weight_map"].values())) == ["model-00001-of-00002.safetensors",
                                                         "model-00002-of-00002.safetensors"]
    loaded = {}
    for name in set(index["weight_map"].values()):
        loaded.update(load_file(dst / name))
    assert loaded.keys() == weights.keys()
    for name, tensor in weights.items():
        assert torch.equal(loaded[name].view(torch.int32), tensor.view(torch.int32))


def test_a_full_disk_fails_with_one_line_naming_the_file_and_leaves_nothing(fixture_ckpt, tmp_path):
    import resource
    import signal
    import subprocess
    import sys

    from tests.conftest import ROOT

    def small_file_limit() -> None:  # files may not grow past 1 kB: a full disk, as write calls see it
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (1024, 1024))

    ref = tmp_path / "ref"
    ref.mkdir()
    (ref / "config.json").write_text(json.dumps({"model_type": "raw"}))
    out = tmp_path / "out"
    out.mkdir()
    result = subprocess.run([sys.executable, "-m", "ckptctl", "export-hf", str(fixture_ckpt("fsdp2_4ranks")),
                             str(out / "hf"), "--hf-config", str(ref), "--arch", "raw", "--no-name-check"],
                            capture_output=True, text=True, cwd=ROOT, preexec_fn=small_file_limit)
    assert (result.returncode, result.stderr) == (
        2, f"ckptctl: error: {out / 'hf' / 'model.safetensors'}: cannot write: File too large\n")
    assert list(out.iterdir()) == []


def test_export_hf_refuses_a_gap_without_offering_an_option_it_lacks(fixture_ckpt, tmp_path):
    """export-hf has no --allow-incomplete: its refusal of rows in no saved chunk does not name one."""
    from dataclasses import replace

    from ckptctl.util.errors import IncompleteCheckpointError
    from ckptctl.commands.export_hf import ExportOptions, check_coverage, plan_export
    from ckptctl.formats.dcp.metadata import open_checkpoint
    from ckptctl.families.base import load_hf_config

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "raw", "architectures": ["Sequential"]}))
    ckpt = open_checkpoint(fixture_ckpt("fsdp2_4ranks"))
    export = plan_export(ckpt, load_hf_config(tmp_path), ExportOptions(arch="raw", name_check=False))
    view = export.sources["model.mlp.fc1.weight"]  # [12, 8] fp32 in four row chunks
    sources = {**export.sources, view.fqn: replace(view, chunks=tuple(view.chunks)[1:])}
    with pytest.raises(IncompleteCheckpointError) as err:
        check_coverage(ckpt, export.targets.values(), sources)
    assert str(err.value) == (f"{ckpt.path}: refusing incomplete checkpoint: mlp.fc1.weight: 24 elements of "
                              f"model.mlp.fc1.weight rows 0..12 are in no saved chunk")
