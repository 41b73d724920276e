"""`gc_pause`: paused phases freeze what they built only in a one-command process, and never after a failure."""

from __future__ import annotations

import gc
import subprocess
import sys
import weakref

import pytest

from ckptctl.util import gc_pause
from ckptctl.util.gc_pause import gc_paused


class _Node:
    pass


def _cyclic_garbage() -> weakref.ref:
    """A cycle nothing refers to, which only the cyclic collector frees; a weak reference to watch it."""
    node = _Node()
    node.self = node
    return weakref.ref(node)


@pytest.fixture
def collector():
    """The collector on and nothing frozen, as a caller's process has it; restored afterwards."""
    was = gc.isenabled()
    gc.enable()
    gc.unfreeze()
    gc.collect()
    yield
    gc.unfreeze()
    if not was:
        gc.disable()


def test_a_library_callers_garbage_stays_collectable(collector, monkeypatch):
    monkeypatch.setattr(gc_pause, "_freeze", False)
    garbage = _cyclic_garbage()
    with gc_paused():
        assert not gc.isenabled()
    assert gc.isenabled() and gc.get_freeze_count() == 0
    gc.collect()
    assert garbage() is None


def test_a_one_command_process_freezes_what_a_phase_built(collector, monkeypatch):
    monkeypatch.setattr(gc_pause, "_freeze", True)
    with gc_paused():
        built = [_Node() for _ in range(100)]
    assert gc.isenabled() and gc.get_freeze_count() >= len(built)


def test_a_failed_phase_freezes_nothing(collector, monkeypatch):
    monkeypatch.setattr(gc_pause, "_freeze", True)
    garbage = _cyclic_garbage()
    with pytest.raises(ValueError), gc_paused():
        raise ValueError("bad input")
    assert gc.isenabled() and gc.get_freeze_count() == 0
    gc.collect()
    assert garbage() is None


def test_the_command_line_program_freezes_and_its_library_does_not():
    probe = ("import sys, ckptctl.util.gc_pause as g, ckptctl.cli as c; before = g._freeze; sys.argv = ['ckptctl', "
             "'--version']\ntry:\n    c.run()\nfinally:\n    print(before, g._freeze, file=sys.stderr)")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stderr.split() == ["False", "True"]
