"""`python bench/gpu_bench.py` on a GPU machine: CPU vs CUDA engine GB/s on one FSDP2 checkpoint, outputs compared byte for byte."""

from __future__ import annotations

import functools
import hashlib
import json
import os
import shutil
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.bench import _build as build  # noqa: E402  (the same FSDP2 checkpoint as `make bench`)


def digest(path: Path) -> dict[str, str]:
    return {p.name: hashlib.blake2b(p.read_bytes(), digest_size=16).hexdigest() for p in sorted(path.iterdir())}


def main() -> None:
    import torch

    from ckptctl import ReshardOptions, reshard
    from ckptctl.core.dtypes import CAST_CHOICES
    from ckptctl.engine import cuda, output
    from ckptctl.engine.dist import launch_local
    from fixtures.gloo import run_ranks

    base = Path(sys.argv[1] if len(sys.argv) > 1 else "/dev/shm/ckb")
    out_dir = Path(os.environ.get("OUT", "/tmp"))
    shutil.rmtree(base, ignore_errors=True)
    base.mkdir(parents=True)
    src = base / "src"
    t0 = time.perf_counter()
    run_ranks(build, 4, str(src), timeout=600)
    src_bytes = sum(p.stat().st_size for p in src.iterdir())
    print(f"source: {src_bytes / 2**30:.2f} GiB in {len(list(src.iterdir()))} files ({time.perf_counter() - t0:.1f}s to build)",
          flush=True)
    gpu = torch.device("cuda", 0)
    if os.environ.get("FAKE_CUDA"):  # local dry run of this script on a CPU machine
        sys.path.insert(0, str(ROOT / "tests"))
        from test_cuda_engine import HostRuntime

        cuda.RUNTIME = HostRuntime()
        gpu = torch.device("cpu")
        sys.modules["ckptctl.commands.reshard"].resolve_device = lambda d: "cpu" if d == "cpu" else "cuda"
        output.executor = lambda d, r=0: (functools.partial(cuda.execute, device=gpu) if d == "cuda"
                                          else __import__("ckptctl.engine.cpu").engine.cpu.execute)
        torch.cuda.get_device_name = lambda i: "fake"
    else:
        torch.cuda.init()
        torch.empty(1, device="cuda")  # CUDA context outside the timings (a CLI run pays ~1 s once)

    real_executor = output.executor

    def run(device: str, dtype: str, workers: int, dst: Path) -> tuple[float, int]:
        shutil.rmtree(dst, ignore_errors=True)
        if device == "cuda-hostid":
            output.executor = lambda d, r=0: functools.partial(cuda.execute, device=gpu, identity_on_gpu=False)
        try:
            opts = ReshardOptions(world_size=3, dtype=CAST_CHOICES[dtype],
                                  device="cuda" if device.startswith("cuda") else "cpu", workers=workers)
            start = time.perf_counter()
            report = reshard(src, dst, opts)
            seconds = time.perf_counter() - start
        finally:
            output.executor = real_executor
        return seconds, report.bytes_written

    cases = [("cpu", "keep", 4), ("cpu", "keep", 8), ("cuda", "keep", 4), ("cuda", "keep", 8), ("cuda-hostid", "keep", 4),
             ("cpu", "bf16", 4), ("cpu", "bf16", 8), ("cuda", "bf16", 4), ("cuda", "bf16", 8)]
    times: dict[tuple, list[float]] = {c: [] for c in cases}
    written: dict[tuple, int] = {}
    digests: dict[tuple, dict] = {}
    reps = int(os.environ.get("REPS", 3))
    for rep in range(reps):
        for case in cases:
            dst = base / "out"
            seconds, nbytes = run(case[0], case[1], case[2], dst)
            times[case].append(seconds)
            written[case] = nbytes
            if rep == 0:
                digests[case] = digest(dst)
            print(f"rep {rep}: {case}: {seconds:.3f}s {nbytes / seconds / 1e9:.2f} GB/s", flush=True)
    same = {dt: len({json.dumps(digests[c], sort_keys=True) for c in cases if c[1] == dt}) == 1 for dt in ("keep", "bf16")}
    rows = []
    for case in cases:
        med = statistics.median(times[case])
        rows.append({"engine": case[0], "dtype": case[1], "threads": case[2], "median_s": round(med, 3),
                     "gb_per_s": round(written[case] / med / 1e9, 2), "bytes_written": written[case],
                     "all_s": [round(t, 3) for t in times[case]]})
    # torchrun, 2 workers, CLI end to end (process start + rendezvous included in wall)
    for device, dtype in (("cpu", "keep"), ("cuda", "keep"), ("cpu", "bf16"), ("cuda", "bf16")):
        if os.environ.get("FAKE_CUDA") and device == "cuda":
            continue
        dst = base / "out"
        shutil.rmtree(dst, ignore_errors=True)
        start = time.perf_counter()
        res = launch_local(2, ["reshard", src, dst, "-n", "3", "--dtype", dtype, "--device", device, "--json"],
                           timeout=300, env={"PYTHONPATH": str(ROOT)})
        wall = time.perf_counter() - start
        if res.returncode != 0:
            rows.append({"engine": f"torchrun2-{device}", "dtype": dtype, "error": res.stderr[-1500:]})
            continue
        doc = json.loads(res.stdout)
        ok = digest(dst) == digests[("cpu", dtype, 4)]
        rows.append({"engine": f"torchrun2-{device}", "dtype": dtype, "threads": 4, "median_s": doc["seconds"],
                     "gb_per_s": doc["gb_per_s"], "wall_s_with_startup": round(wall, 2), "identical_to_single": ok})
        print(rows[-1], flush=True)
    result = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "cpus": os.cpu_count(),
              "src_bytes": src_bytes, "storage": str(base), "reps": reps, "identical_across_engines": same, "rows": rows}
    print(json.dumps(result, indent=1))
    (out_dir / f"bench_{base.name}.json").write_text(json.dumps(result, indent=1))
    shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
