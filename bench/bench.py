"""`make bench`: ckptctl against `cp -r` and torch's own tools on a >= 2 GiB FSDP2 checkpoint.

import-hf reads a >= 2 GiB Hugging Face folder instead (3 safetensors shards and an index,
written once next to the checkpoint): its ratio is to `cp -r` of that folder, in the same run.
The transposed export (`--arch automodel`) reads a >= 2 GiB checkpoint of NeMo Automodel's
native grouped experts, against `cp -r` of it and Automodel's own adapter (`to_hf` of the
checkpoint loaded whole, `save_file`). import-hf of a >= 2 GiB FP8 block-scaled folder
(DeepSeek-V3's layout) dequantizes it to bf16, against `cp -r` of that folder (it writes
twice the bytes it reads).

The checkpoint is written once (cached in bench/.cache) by real FSDP2 on 4 gloo ranks: a
stack of 4096x4096 fp32 linears with AdamW state after one step. Every contender runs as a
subprocess, repetitions alternate between contenders (so drift in the page cache or disk
hits all alike) in a shuffled order that changes each repetition (seeded), so no contender
always runs right after the same one: the torch contenders free gigabytes, and on some VMs
the next run pays for getting that memory back. The table reports the median and fastest
wall time, the median's ratio to `cp -r`, GB/s over the bytes the tool writes, and the
peak RSS of the contender's processes (wait4). All runs read a source that is warm in the page cache, and
each starts after an (untimed) `sync`, so no run pays for writing back the one before it.
ckptctl's modules are byte-compiled first, as an installed package's are (pip compiles at
install; an editable checkout under PYTHONDONTWRITEBYTECODE would recompile on every run).
`cp -r` itself leaves its output in the page cache; `cp -r + sync` is the durable copy,
which is what ckptctl does (fsync before the atomic rename).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import shutil
import statistics
import subprocess
import tempfile
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
CACHE = ROOT / "bench" / ".cache"
LAYERS, WIDTH, SAVE_RANKS, TARGET_RANKS = 11, 4096, 4, 3  # 2.21 GB (2.06 GiB) with AdamW state
SRC = CACHE / f"fsdp2_ws{SAVE_RANKS}_{LAYERS}x{WIDTH}"
HF_SHARDS, HF_PER_SHARD = 3, 12  # 36 fp32 4096x4096 tensors: 2.42 GB (2.25 GiB)
HF_SRC = CACHE / f"hf_{HF_SHARDS}x{HF_PER_SHARD}x{WIDTH}"
AM_LAYERS, AM_EXPERTS, AM_HIDDEN, AM_INTER = 4, 64, 2048, 768  # bf16: 2.42 GB (2.25 GiB) of grouped experts
AM_SRC = CACHE / f"automodel_{AM_LAYERS}x{AM_EXPERTS}x{AM_HIDDEN}x{AM_INTER}"
FP8_SHARDS, FP8_PER_SHARD = 2, 64  # 128 float8_e4m3fn 4096x4096 weights, 128x128-block scales: 2.15 GB (2.00 GiB)
FP8_SRC = CACHE / f"fp8_{FP8_SHARDS}x{FP8_PER_SHARD}x{WIDTH}"
FP8_BLOCK = 128
PY = sys.executable


def _fsdp2_state(warmup_input_scale: float) -> dict:
    """FSDP2 model + AdamW (state initialised by one step) and its DCP state dict, in a gloo rank."""
    import torch
    from torch import nn
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(WIDTH, WIDTH, bias=True) for _ in range(LAYERS)])
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model(torch.randn(2, WIDTH) * warmup_input_scale).sum().backward()
    opt.step()
    msd, osd = get_state_dict(model, opt)
    return {"model": msd, "optim": osd}


def _build(rank: int, world_size: int, out: str) -> None:
    import torch.distributed.checkpoint as dcp

    state = _fsdp2_state(1.0)
    dcp.save(state, checkpoint_id=out)


def _torch_roundtrip(rank: int, world_size: int, src: str, dst: str) -> None:
    """torch's own reshard: FSDP2 model+AdamW at the target world size, dcp.load, dcp.save."""
    import torch.distributed.checkpoint as dcp

    state = _fsdp2_state(0.0)
    dcp.load(state, checkpoint_id=src)
    dcp.save(state, checkpoint_id=dst)


def ensure_checkpoint() -> Path:
    """Generate the source once, in a child process: this parent stays free of torch so that
    the peak RSS its children report (inherited at fork) is their own."""
    if (SRC / ".metadata").exists():
        return SRC
    shutil.rmtree(SRC, ignore_errors=True)
    CACHE.mkdir(parents=True, exist_ok=True)
    print(f"bench: generating {SRC} (FSDP2, {SAVE_RANKS} ranks) ...", flush=True)
    code = (f"import sys; sys.path.insert(0, {str(ROOT)!r}); from bench.bench import _build, SAVE_RANKS; "
            f"from fixtures.gloo import run_ranks; run_ranks(_build, SAVE_RANKS, {str(SRC)!r}, timeout=1200)")
    subprocess.run([PY, "-c", code], check=True)
    return SRC


def _build_hf(out: str) -> None:
    """A safetensors folder as save_pretrained shards one: files of whole tensors and an index."""
    import json

    import torch
    from safetensors.torch import save_file

    root = Path(out)
    root.mkdir(parents=True)
    weight_map = {}
    gen = torch.Generator().manual_seed(0)
    for shard in range(HF_SHARDS):
        name = f"model-{shard + 1:05d}-of-{HF_SHARDS:05d}.safetensors"
        tensors = {f"layers.{shard * HF_PER_SHARD + i}.weight": torch.randn(WIDTH, WIDTH, generator=gen)
                   for i in range(HF_PER_SHARD)}
        save_file(tensors, root / name, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, name))
    total = HF_SHARDS * HF_PER_SHARD * WIDTH * WIDTH * 4
    (root / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}))


def _ensure_folder(folder: Path, last_written: str, build: str) -> Path:
    """`folder`, written once by this module's `build(folder)` in a subprocess (its `last_written`
    file says it is whole)."""
    if (folder / last_written).exists():
        return folder
    shutil.rmtree(folder, ignore_errors=True)
    print(f"bench: generating {folder} ...", flush=True)
    code = f"import sys; sys.path.insert(0, {str(ROOT)!r}); from bench.bench import {build}; {build}({str(folder)!r})"
    subprocess.run([PY, "-c", code], check=True)
    return folder


def ensure_hf_folder() -> Path:
    return _ensure_folder(HF_SRC, "model.safetensors.index.json", "_build_hf")


def _native_experts(layer: int):
    """One MoE layer of NeMo Automodel's native grouped experts (bf16, seeded)."""
    import torch

    gen = torch.Generator().manual_seed(layer)
    return {f"model.layers.{layer}.mlp.experts.gate_and_up_projs":
            torch.randn(AM_EXPERTS, AM_HIDDEN, 2 * AM_INTER, generator=gen).bfloat16(),
            f"model.layers.{layer}.mlp.experts.down_projs":
            torch.randn(AM_EXPERTS, AM_INTER, AM_HIDDEN, generator=gen).bfloat16()}


def _build_automodel(rank: int, world_size: int, out: str) -> None:
    """Expert parallelism on 4 gloo ranks: each layer's stacks `Shard(0)` on the experts."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world_size,))
    state = {}
    for layer in range(AM_LAYERS):
        state.update({k: distribute_tensor(v, mesh, [Shard(0)]) for k, v in _native_experts(layer).items()})
    dcp.save(state, checkpoint_id=out)


def ensure_automodel() -> Path:
    if (AM_SRC / ".metadata").exists():
        return AM_SRC
    shutil.rmtree(AM_SRC, ignore_errors=True)
    print(f"bench: generating {AM_SRC} (Automodel native experts, {SAVE_RANKS} ranks) ...", flush=True)
    code = (f"import sys; sys.path.insert(0, {str(ROOT)!r}); from bench.bench import _build_automodel, SAVE_RANKS; "
            f"from fixtures.gloo import run_ranks; run_ranks(_build_automodel, SAVE_RANKS, {str(AM_SRC)!r}, "
            f"timeout=1200)")
    subprocess.run([PY, "-c", code], check=True)
    return AM_SRC


def _automodel_to_hf(src: str, out: str) -> None:
    """Automodel's own way out: the whole checkpoint loaded (DCP, one process), its adapter's
    `to_hf`, safetensors `save_file` (the anchor of the transposed export)."""
    import torch
    import torch.distributed.checkpoint as dcp
    from nemo_automodel.components.models.common import BackendConfig
    from nemo_automodel.components.models.qwen3_moe.state_dict_adapter import Qwen3MoeStateDictAdapter
    from nemo_automodel.components.moe.config import MoEConfig
    from safetensors.torch import save_file

    meta = dcp.FileSystemReader(src).read_metadata()
    state = {k: torch.empty(m.size, dtype=m.properties.dtype) for k, m in meta.state_dict_metadata.items()}
    dcp.load(state, checkpoint_id=src, no_dist=True)
    moe = MoEConfig(n_routed_experts=AM_EXPERTS, n_shared_experts=0, n_activated_experts=2, n_expert_groups=1,
                    n_limited_groups=1, train_gate=True, gate_bias_update_factor=0.0, aux_loss_coeff=0.0,
                    score_func="softmax", route_scale=1.0, dim=AM_HIDDEN, inter_dim=AM_INTER, moe_inter_dim=AM_INTER,
                    norm_topk_prob=True, dtype=torch.bfloat16)
    hf = Qwen3MoeStateDictAdapter(None, moe, BackendConfig(), dtype=torch.bfloat16).to_hf(state)
    save_file({k: v.contiguous() for k, v in hf.items()}, out, metadata={"format": "pt"})


def _build_fp8(out: str) -> None:
    """An FP8 block-scaled folder as DeepSeek-V3 publishes one: each weight float8_e4m3fn, its
    `weight_scale_inv` float32 per 128x128 block (amax / 448), `quantization_config` in config.json."""
    import json

    import torch
    from safetensors.torch import save_file

    root = Path(out)
    root.mkdir(parents=True)
    weight_map = {}
    gen = torch.Generator().manual_seed(0)
    grid = WIDTH // FP8_BLOCK
    for shard in range(FP8_SHARDS):
        name = f"model-{shard + 1:05d}-of-{FP8_SHARDS:05d}.safetensors"
        tensors = {}
        for i in range(FP8_PER_SHARD):
            tiles = torch.randn(WIDTH, WIDTH, generator=gen).reshape(grid, FP8_BLOCK, grid, FP8_BLOCK)
            scale = tiles.abs().amax(dim=(1, 3)) / 448
            key = f"layers.{shard * FP8_PER_SHARD + i}.weight"
            tensors[key] = (tiles / scale[:, None, :, None]).reshape(WIDTH, WIDTH).to(torch.float8_e4m3fn)
            tensors[f"{key}_scale_inv"] = scale
        save_file(tensors, root / name, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, name))
    (root / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (root / "config.json").write_text(json.dumps({"model_type": "raw", "quantization_config": {
        "quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
        "weight_block_size": [FP8_BLOCK, FP8_BLOCK]}}))


def ensure_fp8_folder() -> Path:
    return _ensure_folder(FP8_SRC, "config.json", "_build_fp8")


def tree_bytes(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def timed(cmd: list[str], env: dict | None = None) -> tuple[float, int, float | None]:
    """Wall seconds, peak RSS (bytes) and, for a ckptctl command (run with --json), the seconds its
    check of the output before the rename took; raises on failure."""
    start = time.perf_counter()
    with tempfile.TemporaryFile() as report:
        proc = subprocess.Popen(cmd, stdout=report, stderr=subprocess.PIPE, env=env)
        _, status, usage = os.wait4(proc.pid, 0)
        seconds = time.perf_counter() - start
        proc.returncode = os.waitstatus_to_exitcode(status)
        err = proc.stderr.read().decode(errors="replace") if proc.stderr else ""
        if proc.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{err[-2000:]}")
        report.seek(0)
        text = report.read().decode(errors="replace")
    check = json.loads(text).get("check_seconds") if "--json" in cmd and text.strip() else None
    return seconds, usage.ru_maxrss * 1024, check


def contenders(src: Path, hf_src: Path, am_src: Path, fp8_src: Path, out: Path,
               hf_config: Path) -> dict[str, tuple[list[str], Path]]:
    ckptctl = [PY, "-m", "ckptctl"]
    torchrun = [PY, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m", "ckptctl"]
    code_rt = ("import sys; sys.path.insert(0, %r); from bench.bench import _torch_roundtrip; "
               "from fixtures.gloo import run_ranks; run_ranks(_torch_roundtrip, %d, %r, %r, timeout=1800)")
    return {
        "cp -r": (["cp", "-r", str(src), str(out / "cp")], out / "cp"),
        "cp -r + sync": (["sh", "-c", f"cp -r {src} {out / 'cps'} && sync -f {out / 'cps'}"], out / "cps"),
        "torch dcp_to_torch_save": ([PY, "-c", "import sys; from torch.distributed.checkpoint.format_utils import "
                                     f"dcp_to_torch_save as f; f({str(src)!r}, {str(out / 'single.pt')!r})"],
                                    out / "single.pt"),
        "ckptctl export-torch": ([*ckptctl, "export-torch", str(src), str(out / "export.pt")], out / "export.pt"),
        "ckptctl export-torch --no-sync": ([*ckptctl, "export-torch", str(src), str(out / "exportn.pt"), "--no-sync"],
                                           out / "exportn.pt"),
        f"torch DCP load+save at {TARGET_RANKS} ranks": (
            [PY, "-c", code_rt % (str(ROOT), TARGET_RANKS, str(src), str(out / "torch_rt"))], out / "torch_rt"),
        f"ckptctl reshard -n {TARGET_RANKS}": (
            [*ckptctl, "reshard", str(src), str(out / "ck"), "--world-size", str(TARGET_RANKS)], out / "ck"),
        f"ckptctl reshard -n {TARGET_RANKS} --no-sync": (
            [*ckptctl, "reshard", str(src), str(out / "ckn"), "--world-size", str(TARGET_RANKS), "--no-sync"],
            out / "ckn"),
        f"ckptctl reshard -n {TARGET_RANKS} (torchrun, 2 workers)": (
            [*torchrun, "reshard", str(src), str(out / "ck2"), "--world-size", str(TARGET_RANKS)], out / "ck2"),
        "ckptctl export-hf --arch raw (weights only)": (
            [*ckptctl, "export-hf", str(src), str(out / "hf"), "--hf-config", str(hf_config), "--arch", "raw",
             "--no-name-check"],  # a stack of nn.Linear: no transformers model to check names against
            out / "hf"),
        "ckptctl export-hf --arch raw --no-sync": (
            [*ckptctl, "export-hf", str(src), str(out / "hfn"), "--hf-config", str(hf_config), "--arch", "raw",
             "--no-name-check", "--no-sync"], out / "hfn"),
        HF_COPY: (["cp", "-r", str(hf_src), str(out / "hfcp")], out / "hfcp"),
        "cp -r + sync (HF folder)": (["sh", "-c", f"cp -r {hf_src} {out / 'hfcps'} && sync -f {out / 'hfcps'}"],
                                     out / "hfcps"),
        f"ckptctl import-hf -n {TARGET_RANKS} (HF folder)": (
            [*ckptctl, "import-hf", str(hf_src), str(out / "imp"), "-n", str(TARGET_RANKS), "--no-name-check"],
            out / "imp"),
        f"ckptctl import-hf -n {TARGET_RANKS} --no-sync (HF folder)": (
            [*ckptctl, "import-hf", str(hf_src), str(out / "impn"), "-n", str(TARGET_RANKS), "--no-name-check",
             "--no-sync"], out / "impn"),
        FP8_COPY: (["cp", "-r", str(fp8_src), str(out / "fp8cp")], out / "fp8cp"),
        "cp -r + sync (FP8 folder)": (["sh", "-c", f"cp -r {fp8_src} {out / 'fp8cps'} && sync -f {out / 'fp8cps'}"],
                                      out / "fp8cps"),
        f"ckptctl import-hf -n {TARGET_RANKS} (FP8 folder, dequantized to bf16)": (
            [*ckptctl, "import-hf", str(fp8_src), str(out / "fp8imp"), "-n", str(TARGET_RANKS), "--no-name-check"],
            out / "fp8imp"),
        f"ckptctl import-hf -n {TARGET_RANKS} --no-sync (FP8 folder, dequantized to bf16)": (
            [*ckptctl, "import-hf", str(fp8_src), str(out / "fp8impn"), "-n", str(TARGET_RANKS), "--no-name-check",
             "--no-sync"], out / "fp8impn"),
        AM_COPY: (["cp", "-r", str(am_src), str(out / "amcp")], out / "amcp"),
        "Automodel load + to_hf + save_file": (
            [PY, "-c", f"import sys; sys.path.insert(0, {str(ROOT)!r}); from bench.bench import _automodel_to_hf; "
                       f"_automodel_to_hf({str(am_src)!r}, {str(out / 'am.safetensors')!r})"],
            out / "am.safetensors"),
        "ckptctl export-hf --arch automodel (transposed experts)": (
            [*ckptctl, "export-hf", str(am_src), str(out / "amhf"), "--hf-config", str(hf_config), "--arch",
             "automodel", "--no-name-check"], out / "amhf"),
        "ckptctl export-hf --arch automodel --no-sync": (
            [*ckptctl, "export-hf", str(am_src), str(out / "amhfn"), "--hf-config", str(hf_config), "--arch",
             "automodel", "--no-name-check", "--no-sync"], out / "amhfn"),
    }


HF_COPY = "cp -r (HF folder)"
"""The base of the import-hf rows: they read the HF folder, not the checkpoint."""
AM_COPY = "cp -r (Automodel checkpoint)"
"""The base of the Automodel rows: they read a checkpoint of native grouped experts."""
FP8_COPY = "cp -r (FP8 folder)"
"""The base of the FP8 import row: it reads an FP8 block-scaled folder, and writes twice its bytes (bf16)."""
BASES = {"FP8": FP8_COPY, "import-hf": HF_COPY, "Automodel": AM_COPY, "automodel": AM_COPY}


def write_hf_config(path: Path) -> Path:
    import json

    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps({"model_type": "raw", "architectures": ["Sequential"]}))
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--only", nargs="*", help="substrings of contender names to run")
    args = parser.parse_args()
    src = ensure_checkpoint().resolve()  # resolved: `cp -r` of a link to a folder copies the link
    hf_src = ensure_hf_folder().resolve()
    am_src = ensure_automodel().resolve()
    fp8_src = ensure_fp8_folder().resolve()
    src_bytes = tree_bytes(src)
    out = CACHE / "out"
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    hf_config = write_hf_config(CACHE / "hf-config")
    subprocess.run([PY, "-m", "compileall", "-q", str(ROOT / "ckptctl")], check=True)
    runs = {name: ([*cmd, "--json"] if name.startswith("ckptctl") else cmd, target)  # --json: its check's seconds
            for name, (cmd, target) in contenders(src, hf_src, am_src, fp8_src, out, hf_config).items()
            if not args.only or any(s in name for s in args.only)}
    for warm in (src, hf_src, am_src, fp8_src):  # warm the cache with the sources the contenders read
        if any(str(warm) in " ".join(cmd) for cmd, _ in runs.values()):
            subprocess.run(["cat", *map(str, warm.iterdir())], stdout=subprocess.DEVNULL, check=True)
    times: dict[str, list[float]] = {n: [] for n in runs}
    rss: dict[str, int] = {n: 0 for n in runs}
    checks: dict[str, list[float]] = {n: [] for n in runs}
    written: dict[str, int] = {}
    failed: dict[str, str] = {}
    for rep in range(args.reps):
        order = list(runs)
        random.Random(rep).shuffle(order)  # a new order each repetition, the same in every bench run
        for name in order:
            cmd, target = runs[name]
            if name in failed:
                continue
            shutil.rmtree(target, ignore_errors=True) if target.is_dir() else target.unlink(missing_ok=True)
            os.sync()
            try:
                seconds, peak, check = timed(cmd)
            except RuntimeError as exc:
                failed[name] = str(exc).splitlines()[-1]
                continue
            times[name].append(seconds)
            rss[name] = max(rss[name], peak)
            if check is not None:
                checks[name].append(check)
            written[name] = tree_bytes(target)
            print(f"  rep {rep + 1}: {name}: {seconds:.2f}s", flush=True)
    base = statistics.median(times["cp -r"]) if times.get("cp -r") else None
    base_min = min(times["cp -r"]) if times.get("cp -r") else None
    hf_bytes = tree_bytes(hf_src)
    am_bytes = tree_bytes(am_src)
    print(f"\nHF folder (import-hf): {hf_bytes / 1e9:.2f} GB ({hf_bytes / 2**30:.2f} GiB); import-hf rows are also "
          f"given against {HF_COPY!r}")
    print(f"Automodel native experts (bf16 [{AM_EXPERTS}, {AM_HIDDEN}, {2 * AM_INTER}] and [{AM_EXPERTS}, {AM_INTER}, "
          f"{AM_HIDDEN}] x {AM_LAYERS} layers): {am_bytes / 1e9:.2f} GB; its rows are also given against {AM_COPY!r}")
    fp8_bytes = tree_bytes(fp8_src)
    print(f"FP8 block-scaled folder (e4m3, 128x128 scales): {fp8_bytes / 1e9:.2f} GB ({fp8_bytes / 2**30:.2f} GiB); "
          f"its import-hf row (bf16 out: twice the bytes) is also given against {FP8_COPY!r}")
    print(f"source: {src_bytes / 1e9:.2f} GB ({src_bytes / 2**30:.2f} GiB) in {len(list(src.iterdir()))} files; machine: "
          f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}, {args.reps} reps\n")
    print("| contender | median s | fastest s | ratio to cp -r (medians) | ratio (fastest) | GB/s written | peak RSS MB "
          "| output check s (share) |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for name in runs:
        if name in failed:
            print(f"| {name} | failed: {failed[name][:80]} | | | | | |")
            continue
        med = statistics.median(times[name])
        ratio = f"{med / base:.2f}" if base else "-"
        ratio_min = f"{min(times[name]) / base_min:.2f}" if base_min else "-"
        other = next((b for key, b in BASES.items() if key in name and b != name and times.get(b)), None)
        if other is not None:
            ratio += f" ({med / statistics.median(times[other]):.2f} to {other})"
            ratio_min += f" ({min(times[name]) / min(times[other]):.2f})"
        check = statistics.median(checks[name]) if checks[name] else None
        shown = f"{check:.3f} ({check / med:.1%})" if check is not None else "-"
        print(f"| {name} | {med:.2f} | {min(times[name]):.2f} | {ratio} | {ratio_min} | {written[name] / med / 1e9:.2f} "
              f"| {rss[name] / 1e6:.0f} | {shown} |")
    shutil.rmtree(out, ignore_errors=True)


if __name__ == "__main__":
    main()
