"""`make bench-scale`: structure at scale — millions of tiny chunks, as FSDP2 at 1,024 ranks writes.

    python bench/scale.py [--sizes 256x300,1024x160] [--repeat 3] [--torchrun]

A 70B model with AdamW saved at 1,024 ranks has ~2,400 tensors × 1,024 chunks ≈ 2.5M chunks
in `.metadata`; its bytes are not what makes it slow, its structure is. `generate` writes
such a checkpoint with tiny tensors: RANKS × TENSORS chunks (each rank's [4, 16] fp32 row
block of every tensor), one `torch.save` item per chunk in the rank's `__r_0.distcp`, and a
`.metadata` pickled from torch's own metadata classes, exactly as DCP's FileSystemWriter
lays them out (items are one torch.save archive, repeated: their bytes are not the point).
Checkpoints are cached in bench/.cache/scale_RxT.

Each contender runs as a subprocess after an untimed `sync`, warm page cache; the table gives
the median wall time (import included), its ratio to torch's own `read_metadata` of the
same checkpoint, the time per chunk, and the peak RSS (wait4). `--torchrun` adds
`torchrun --nproc-per-node 2 ckptctl reshard`. Preset `2.5M` is 1024x2500.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CACHE = ROOT / "bench" / ".cache"
PY = sys.executable
CKPTCTL = [PY, "-m", "ckptctl"]
ROWS, COLS = 4, 16
PRESETS = {"2.5M": "1024x2500", "46k-experts": "64x46000"}
READ_METADATA = ("import sys; from torch.distributed.checkpoint import FileSystemReader; "
                 "md = FileSystemReader(sys.argv[1]).read_metadata(); "
                 "print(sum(len(v.chunks) for v in md.state_dict_metadata.values()))")


def generate(out: Path, ranks: int, tensors: int) -> None:
    """Write the checkpoint (into a temporary sibling, renamed when complete)."""
    import io

    import torch
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (
        ChunkStorageMetadata,
        Metadata,
        MetadataIndex,
        StorageMeta,
        TensorProperties,
        TensorStorageMetadata,
    )

    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    buf = io.BytesIO()
    torch.save(torch.arange(ROWS * COLS, dtype=torch.float32).reshape(ROWS, COLS), buf)
    item = buf.getvalue()
    for r in range(ranks):
        (tmp / f"__{r}_0.distcp").write_bytes(item * tensors)
    fqns = [f"model.layers.{t}.weight" for t in range(tensors)]
    props = TensorProperties(dtype=torch.float32)
    sd = {fqn: TensorStorageMetadata(props, torch.Size([ranks * ROWS, COLS]),
                                     [ChunkStorageMetadata(torch.Size([r * ROWS, 0]), torch.Size([ROWS, COLS]))
                                      for r in range(ranks)]) for fqn in fqns}
    storage = {MetadataIndex(fqn, torch.Size([r * ROWS, 0]), r): _StorageInfo(f"__{r}_0.distcp", t * len(item),
                                                                               len(item))
               for r in range(ranks) for t, fqn in enumerate(fqns)}
    md = Metadata(state_dict_metadata=sd, planner_data={fqn: tuple(fqn.split(".")) for fqn in fqns},
                  storage_data=storage, storage_meta=StorageMeta(checkpoint_id=None, save_id="bench", modules=[]))
    import pickle

    (tmp / ".metadata").write_bytes(pickle.dumps(md))
    tmp.rename(out)


def checkpoint(ranks: int, tensors: int) -> Path:
    path = CACHE / f"scale_{ranks}x{tensors}"
    if not path.exists():
        started = time.perf_counter()
        print(f"generating {path.name} ({ranks * tensors:,} chunks) ...", file=sys.stderr, flush=True)
        # in a child: torch's gigabytes would otherwise count in every later child's peak RSS (fork)
        subprocess.run([PY, __file__, "--generate", str(ranks), str(tensors)], check=True)
        print(f"  {time.perf_counter() - started:.0f} s", file=sys.stderr, flush=True)
    return path


def measured(cmd: list[str], env: dict[str, str] | None = None) -> tuple[float, float, float | None]:
    """(wall seconds, peak RSS MB over the command's processes, the seconds a writing ckptctl run
    with --json spent checking its output before the rename) of one run after an untimed sync."""
    os.sync()
    started = time.perf_counter()
    with tempfile.TemporaryFile() as report:
        proc = subprocess.Popen(cmd, stdout=report, stderr=subprocess.PIPE, env=env)
        _, status, usage = os.wait4(proc.pid, 0)
        wall = time.perf_counter() - started
        err = proc.stderr.read().decode() if proc.stderr else ""
        if os.waitstatus_to_exitcode(status) != 0:
            raise SystemExit(f"{' '.join(map(str, cmd))} failed:\n{err[-2000:]}")
        report.seek(0)
        text = report.read().decode(errors="replace")
    check = json.loads(text).get("check_seconds") if "--json" in cmd and "reshard" in cmd else None
    return wall, usage.ru_maxrss / 1024, check


def contenders(src: Path, ranks: int, torchrun: bool) -> list[tuple[str, list[str], dict[str, str] | None]]:
    dst = CACHE / f"{src.name}.out"
    world = max(1, ranks // 2)
    rows = [
        ("torch read_metadata", [PY, "-c", READ_METADATA, str(src)], None),
        ("ckptctl inspect --check", CKPTCTL + ["inspect", "--check", str(src)], None),
        ("ckptctl inspect --json", CKPTCTL + ["inspect", "--json", str(src)], None),
        ("ckptctl reshard --dry-run", CKPTCTL + ["reshard", "--dry-run", str(src), str(dst), "-n", str(world)], None),
        ("ckptctl reshard", CKPTCTL + ["reshard", str(src), str(dst), "-n", str(world), "--force", "--json"], None),
    ]
    if torchrun:
        launcher = str(Path(PY).with_name("torchrun"))
        rows.append(("torchrun -nproc 2 ckptctl reshard",
                     [launcher, "--standalone", "--nproc-per-node", "2", "-m", "ckptctl", "reshard", str(src), str(dst),
                      "-n", str(world), "--force", "--json"], None))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="256x300,1024x160", help="RANKSxTENSORS,... or a preset: 2.5M, 46k-experts")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--torchrun", action="store_true")
    parser.add_argument("--generate", nargs=2, type=int, metavar=("RANKS", "TENSORS"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.generate:
        ranks, tensors = args.generate
        generate(CACHE / f"scale_{ranks}x{tensors}", ranks, tensors)
        return
    subprocess.run([PY, "-m", "compileall", "-q", str(ROOT / "ckptctl")], check=True)
    print("| checkpoint | contender | median s | vs torch read_metadata | µs per chunk | peak RSS MB "
          "| output check s (share) |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for size in args.sizes.split(","):
        ranks, tensors = (int(v) for v in PRESETS.get(size, size).split("x"))
        src = checkpoint(ranks, tensors)
        chunks = ranks * tensors
        rows = contenders(src, ranks, args.torchrun)
        results: dict[str, list[tuple[float, float, float | None]]] = {name: [] for name, _, _ in rows}
        for _ in range(args.repeat):
            for name, cmd, env in rows:
                results[name].append(measured(cmd, env))
        base = statistics.median(w for w, _, _ in results["torch read_metadata"])
        for name, _, _ in rows:
            wall = statistics.median(w for w, _, _ in results[name])
            rss = max(r for _, r, _ in results[name])
            checks = [c for _, _, c in results[name] if c is not None]
            check = f"{statistics.median(checks):.2f} ({statistics.median(checks) / wall:.1%})" if checks else "-"
            print(f"| {ranks}×{tensors} = {chunks:,} chunks | {name} | {wall:.2f} | {wall / base:.2f} | "
                  f"{wall / chunks * 1e6:.1f} | {rss:.0f} | {check} |", flush=True)
        shutil.rmtree(CACHE / f"{src.name}.out", ignore_errors=True)


if __name__ == "__main__":
    main()
