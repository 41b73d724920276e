"""The Python API as a script uses it: `import ckptctl`, then the documented names."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
import torch

from tests.conftest import ROOT
from tests.cli.test_reshard_cli import flat_state

SCRIPT = textwrap.dedent('''
    import json, sys
    import ckptctl

    src, dst = sys.argv[1], sys.argv[2]
    lazy = sorted(m for m in ("torch", "rich", "typer") if m in sys.modules)
    ckpt = ckptctl.open_checkpoint(src)
    opts = ckptctl.ReshardOptions(world_size=3, include=["model.*"])
    report = ckptctl.reshard(src, dst, opts, verify=True)
    compared = ckptctl.diff(src, dst)
    saved = ckptctl.export_torch(src, dst + ".pt", ckptctl.ExportTorchOptions(include=["model.*"]))
    try:
        ckptctl.open_checkpoint(dst + "-missing")
    except ckptctl.CkptctlError as exc:
        error = str(exc)
    print(json.dumps({
        "imported_at_start": lazy,
        "tensors": len(ckpt.tensors), "bytes_entries": len(ckpt.bytes_entries),
        "problems": [p.message for p in ckptctl.analysis(ckpt).problems],
        "fc1": [list(ckpt.tensors["model.mlp.fc1.weight"].shape), ckpt.tensors["model.mlp.fc1.weight"].dtype_name],
        "report": [report.world_size, report.tensors, report.verified, report.write_bytes == report.bytes_written],
        "export_torch": saved.tensors,
        "diff": [compared.equal, compared.counts["equal"], compared.counts["missing in B"]],
        "error": error,
    }))
''')


def test_a_script_opens_checks_and_reshards_through_the_api(fixture_ckpt, tmp_path):
    src = fixture_ckpt("fsdp2_4ranks")
    script = tmp_path / "script.py"
    script.write_text(SCRIPT)
    dst = tmp_path / "ws3"
    result = subprocess.run([sys.executable, str(script), str(src), str(dst)], capture_output=True, text=True,
                            cwd=tmp_path, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert result.returncode == 0, result.stderr
    doc = json.loads(result.stdout)
    assert doc == {
        "imported_at_start": [],  # `import ckptctl` pulls in neither torch nor the CLI
        "tensors": 32, "bytes_entries": 13, "problems": [],
        "fc1": [[12, 8], "float32"],
        "report": [3, 8, True, True],
        "export_torch": 8,
        "diff": [False, 8, 24],  # the reshard kept model.* only
        "error": f"{dst}-missing: no such file or directory",
    }
    want, got = flat_state(src, tmp_path), flat_state(dst, tmp_path)
    assert sorted(got) == sorted(k for k in want if k.startswith("model."))
    for key, value in got.items():
        assert torch.equal(value, want[key]), key
    saved = torch.load(f"{dst}.pt", weights_only=True)["model"]
    assert sorted(saved) == sorted(k.removeprefix("model.") for k in got)
    for key, value in saved.items():
        assert torch.equal(value, want[f"model.{key}"]), key


def test_the_api_names_are_listed_and_documented():
    import ckptctl

    for name in ckptctl.__all__:
        value = getattr(ckptctl, name)
        if callable(value):
            assert value.__doc__, name


def test_each_function_is_itself_after_every_module_is_imported():
    """No module of the package sits where an API function is expected: importing every module
    the API names (as `ckptctl.ReshardOptions` or another module would) leaves `ckptctl.reshard`
    the function."""
    script = ("import importlib, types, ckptctl\n"
              "for module in sorted(set(ckptctl._API.values())): importlib.import_module(module)\n"
              "print(sorted(n for n in ckptctl.__all__ if isinstance(getattr(ckptctl, n), types.ModuleType)))\n"
              "print(callable(ckptctl.reshard), ckptctl.reshard.__module__)")
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT, check=True)
    assert result.stdout.splitlines() == ["[]", "True ckptctl.commands.reshard"]


def test_every_writing_command_s_options_share_the_run_options_as_keywords():
    """reshard's, import-hf's, export-torch's and export-hf's options are one `RunOptions` each:
    the selection, cast and engine settings named alike everywhere. export-hf's take keywords
    only: `dtype`, once its third positional field, cannot silently become another."""
    import dataclasses

    import ckptctl
    from ckptctl.commands.options import RunOptions

    shared = [f.name for f in dataclasses.fields(RunOptions)]
    for options in (ckptctl.ReshardOptions, ckptctl.ImportOptions, ckptctl.ExportTorchOptions, ckptctl.ExportOptions):
        assert issubclass(options, RunOptions), options
        assert [f.name for f in dataclasses.fields(options)][:len(shared)] == shared, options
    opts = ckptctl.ExportOptions(arch="raw", tp=2, dtype=None, include=("model.*",), workers=2, sync=False,
                                 layout="distributed", world_size=2)
    assert (opts.arch, opts.tp, opts.include, opts.workers, opts.sync, opts.max_shard_size) == \
        ("raw", 2, ("model.*",), 2, False, "5GB")
    with pytest.raises(TypeError, match="positional"):
        ckptctl.ExportOptions("raw")
