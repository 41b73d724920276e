"""Families, formats, engines, planners, checks and commands reach files through
`ckptctl.storage.store` only, so that another store (an object store) plugs in without touching
them: no module under those packages opens, maps, lists, stats, globs, reads or writes a path or a
descriptor (`os.pread` on a `fileno()`), asks whether a path is a folder or a file, or commits an
output, by itself. The few calls that touch no checkpoint (the process's own
/proc files, /dev/null, a pipe), that only share a name with a path call, or that are a real
consumer reading the output as it would (safetensors' `safe_open`, the verification's oracle) are
listed by name here, each with its reason, so a new one fails this test until it goes through the
store or is listed."""

from __future__ import annotations

import ast

from tests.conftest import ROOT

SEAMED = ("families", "formats", "engine", "planners", "checks", "commands")
"""Packages under ckptctl that must go through the store."""
PATH_CALLS = {"open", "read_bytes", "read_text", "write_bytes", "write_text", "iterdir", "stat", "lstat",
              "listdir", "scandir", "fdopen", "mmap", "walk", "atomic_directory", "atomic_file", "open_source",
              "safe_open", "exists", "lexists", "is_dir", "is_file", "glob", "rglob", "fileno", "pread", "preadv",
              "pwrite", "pwritev", "copy_file_range", "ftruncate", "fsync"}
"""Calls that open, map, list or stat a path or descriptor (builtin `open`, `os.open`, `Path.open`,
`mmap.mmap`, `os.listdir`, `source_files.open_source`, safetensors' `safe_open` …) or commit an
output folder behind the store's back. A call on a store (`store_for(path).atomic_file(…)`,
`store.list(…)`) goes through it."""
NOT_CHECKPOINT_FILES = {
    ("formats/pickle/hash_guard.py", "os.open"): "/dev/null for the forked probe's output",
    ("formats/pickle/hash_guard.py", "open"): "/proc/self/statm: the probe's own memory",
    ("engine/helper.py", "os.fdopen"): "the pipe from a helper process",
    ("engine/__init__.py", "glob.glob"): "/dev/nvidia*: whether the machine has a GPU",
    ("engine/dist.py", "os.path.exists"): "/sys/class/net/lo: the loopback interface gloo workers talk over",
    ("families/expected.py", ".read_text"): "ckptctl's own cache of transformers' names (~/.cache/ckptctl)",
    ("families/expected.py", "os.fdopen"): "ckptctl's own cache of transformers' names (~/.cache/ckptctl)",
    ("commands/diff.py", "side_a.read_bytes"): "`Side.read_bytes`: a bytes entry by name, through the side's reader",
    ("commands/diff.py", "side_b.read_bytes"): "`Side.read_bytes`: a bytes entry by name, through the side's reader",
    ("commands/export_hf.py", "safe_open"): "--verify's oracle: the written files read by safetensors' own reader, "
                                            "as transformers reads them",
    ("checks/verify.py", "safe_open"): "--verify's oracle: a written safetensors file read by safetensors' own "
                                       "reader, not by ckptctl's",
}


def _on_a_store(owner: ast.expr) -> bool:
    """Whether `owner` is a store: `store_for(…)`, or a name ending in `store`."""
    if isinstance(owner, ast.Call):
        return isinstance(owner.func, ast.Name) and owner.func.id == "store_for"
    name = owner.attr if isinstance(owner, ast.Attribute) else owner.id if isinstance(owner, ast.Name) else ""
    return name.lower().endswith("store")


def _name(func: ast.expr) -> str | None:
    """`open`, `os.open`, `.read_bytes` … for a call of one of PATH_CALLS, else None."""
    if isinstance(func, ast.Name):
        return func.id if func.id in PATH_CALLS else None
    if isinstance(func, ast.Attribute) and func.attr in PATH_CALLS and not _on_a_store(func.value):
        owner = ast.unparse(func.value) if isinstance(func.value, (ast.Name, ast.Attribute)) else ""
        return f"{owner}.{func.attr}"
    return None


def path_calls(package: str) -> dict[tuple[str, str], list[int]]:
    """(module, call) → the lines where a module under ckptctl/`package` calls one of PATH_CALLS."""
    found: dict[tuple[str, str], list[int]] = {}
    for module in sorted((ROOT / "ckptctl" / package).rglob("*.py")):
        tree = ast.parse(module.read_text(), str(module))
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and (name := _name(node.func)) is not None:
                key = (module.relative_to(ROOT / "ckptctl").as_posix(), name)
                found.setdefault(key, []).append(node.lineno)
    return found


def test_formats_and_engines_open_list_and_stat_nothing_but_through_the_store():
    found = {key: lines for package in SEAMED for key, lines in path_calls(package).items()}
    assert {key: lines for key, lines in found.items() if key not in NOT_CHECKPOINT_FILES} == {}
    assert set(NOT_CHECKPOINT_FILES) <= set(found)  # an entry no longer needed is dropped


def test_the_seam_check_finds_opens_listings_stats_descriptor_reads_kinds_and_commits_and_lets_store_calls_by():
    source = ("import os\nopen('x')\nos.open('x', 0)\nos.listdir('.')\nPath('x').stat()\nfolder.iterdir()\n"
              "atomic_directory(dst, True)\nos.pread(fd, 1, 0)\nstore.open_read(path)\nopen_source(path)\n"
              "atomic.atomic_file(out, True)\nstore_for(out).atomic_file(out, True)\nself._store.list(folder)\n"
              "LOCAL_STORE.atomic_file(out, True)\nhandle.fileno()\nroot.glob('*.safetensors')\n"
              "(root / 'x').is_dir()\nos.path.lexists(p)\nstore.kind(p)\nstore_for(p).glob(p, '*')\n"
              "handle.read_at(3, 9)\nread(3, 9)\n")
    calls = [_name(node.func) for node in ast.walk(ast.parse(source)) if isinstance(node, ast.Call)]
    assert sorted(filter(None, calls)) == [".is_dir", ".stat", "atomic.atomic_file", "atomic_directory",
                                              "folder.iterdir", "handle.fileno", "open", "open_source", "os.listdir",
                                              "os.open", "os.path.lexists", "os.pread", "root.glob"]
