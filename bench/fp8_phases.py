"""Where an FP8 → bf16 import-hf's time goes (issue #37): each phase alone, on `make bench`'s FP8 folder.

`python bench/fp8_phases.py [--threads 2]` times, in one run, each after an untimed `sync`: the
import itself (`--json`: its output check's seconds, and `--no-sync`), `cp -r` of the FP8 folder and
of an equal-size bf16 folder (the import's own output: the physical floor for writing its bytes),
with and without sync; then, in this process, each phase alone: reading the FP8 codes (positioned
reads from the warm page cache), decoding them (`dequantized_into`, the import's decoder, into a
reused block: CPU only), writing 4.3 GB (positioned writes of one reused block into three files)
and its fsync. Threads: the import's worker count, each thread taking every `threads`-th block.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.bench import CACHE, PY, ensure_fp8_folder, timed, tree_bytes  # noqa: E402
from ckptctl.engine.cpu import DEQUANT_BLOCK_BYTES  # noqa: E402

BLOCK = DEQUANT_BLOCK_BYTES


def _cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _phase(name: str, work, threads: int, sync: bool = True) -> None:
    """Run `work(k, threads)` on `threads` threads (after an untimed `sync`, with `sync`); print
    wall and CPU seconds."""
    if sync:
        os.sync()
    cpu, start = _cpu(), time.perf_counter()
    pool = [threading.Thread(target=work, args=(k, threads)) for k in range(threads)]
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    print(f"| {name} | {time.perf_counter() - start:.2f} | {_cpu() - cpu:.2f} |", flush=True)


def commands(src: Path) -> None:
    """The import and the copies, as subprocesses of this process before it imports torch (a child's
    peak RSS counts what it inherits at the fork)."""
    out, imported = CACHE / "fp8_phases", CACHE / "fp8_phases_import"
    ckptctl = [PY, "-m", "ckptctl", "import-hf", str(src), str(imported), "-n", "3", "--no-name-check", "--json"]
    for path in (out, imported, CACHE / "fp8_phases_nosync"):
        shutil.rmtree(path, ignore_errors=True)
    rows = []
    for name, cmd, target in (
            ("ckptctl import-hf -n 3 (FP8 → bf16)", ckptctl, imported),
            ("cp -r of the FP8 folder", ["cp", "-r", str(src), str(out)], out),
            ("cp -r + sync of the FP8 folder", ["sh", "-c", f"cp -r {src} {out} && sync -f {out}"], out),
            ("cp -r of the bf16 output (4.3 GB)", ["cp", "-r", str(imported), str(out)], out),
            ("cp -r + sync of the bf16 output", ["sh", "-c", f"cp -r {imported} {out} && sync -f {out}"], out),
            ("ckptctl import-hf -n 3 --no-sync", [*ckptctl[:5], str(CACHE / "fp8_phases_nosync"), *ckptctl[6:],
                                                  "--no-sync"], CACHE / "fp8_phases_nosync")):
        os.sync()
        seconds, peak, check = timed(cmd)
        rows.append((name, seconds, peak, check))
        if target != imported:  # the import's output stays: the bf16 folder the copies copy
            shutil.rmtree(target, ignore_errors=True)
    shutil.rmtree(imported, ignore_errors=True)
    base = rows[1][1]
    print("| command | s | × cp -r of the FP8 folder | peak RSS MB | output check s |\n|---|---:|---:|---:|---:|")
    for name, seconds, peak, check in rows:
        print(f"| {name} | {seconds:.2f} | {seconds / base:.2f} | {peak / 1e6:.0f} | "
              f"{'-' if check is None else f'{check:.3f}'} |", flush=True)


def phases(src: Path, threads: int) -> None:
    """Each phase of the import alone, in this process: read, decode, write, fsync."""
    import torch

    from ckptctl.core.dtypes import bfloat16
    from ckptctl.formats.dcp.items import ItemReader
    from ckptctl.formats.safetensors.quantized import dequantized_into, quant_format
    from ckptctl.formats.safetensors.reader import open_safetensors_folder

    torch.set_num_threads(1)  # each thread one core, as the import's workers
    out = CACHE / "fp8_phases"
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    config = json.loads((src / "config.json").read_text())
    ckpt = open_safetensors_folder(src, quant_format(config, src / "config.json"), bfloat16)
    blocks = [(entry, chunk, at, min(BLOCK, chunk.sizes[-2] * chunk.sizes[-1] * 2 - at))
              for entry in ckpt.tensors.values() for chunk in entry.chunks
              for at in range(0, chunk.sizes[-2] * chunk.sizes[-1] * 2, BLOCK)]
    print(f"\n{len(blocks)} blocks of {BLOCK >> 10} KiB, {threads} threads\n")
    print("| phase | wall s | CPU s |\n|---|---:|---:|")
    with ItemReader(ckpt) as reader:
        def read(k: int, n: int) -> None:
            buf = bytearray(BLOCK // 2)
            for entry, chunk, at, size in blocks[k::n]:
                reader.handle(chunk.file).readinto_at(memoryview(buf)[:size // 2], chunk.offset + at // 2)

        def decode(k: int, n: int) -> None:
            buf = memoryview(bytearray(BLOCK))
            for entry, chunk, at, size in blocks[k::n]:
                dequantized_into(entry, chunk, at, buf[:size], reader.handle)

        _phase("read the FP8 codes (2.1 GB, page cache)", read, threads)
        _phase("decode to bf16 (read codes and scales, widen, scale, round)", decode, threads)
    fds = [os.open(out / f"__{r}_0.distcp", os.O_WRONLY | os.O_CREAT, 0o644) for r in range(3)]
    data = os.urandom(BLOCK)

    def write(k: int, n: int) -> None:
        offsets = [0, 0, 0]
        for i, (*_, size) in enumerate(blocks):
            f = i % 3
            if i % n == k:
                os.pwrite(fds[f], memoryview(data)[:size], offsets[f])
            offsets[f] += size

    _phase("write 4.3 GB of bf16 (page cache)", write, threads)
    _phase("fsync it", lambda k, n: [os.fsync(fd) for fd in fds[k::n]], threads, sync=False)
    for fd in fds:
        os.close(fd)
    shutil.rmtree(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    src = ensure_fp8_folder().resolve()
    subprocess.run(["cat", *map(str, src.iterdir())], stdout=subprocess.DEVNULL, check=True)
    print(f"FP8 folder {tree_bytes(src) / 1e9:.2f} GB, load average {os.getloadavg()[0]:.1f}\n")
    commands(src)
    phases(src, args.threads)
    print(f"\nload average after: {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
