"""Write pickles that name torch's globals without importing torch.

torch loads `.metadata` and each record's `data.pkl` by unpickling, so ckptctl must write
pickles that reference torch's classes (`torch.Size`, DCP's metadata classes,
`torch._utils._rebuild_tensor_v2`, ...). `pickle` refuses to name a global it cannot
import, and importing torch costs more than a gigabyte of copying, so references are
plain values here: `Global` names one, `Call` pickles as calling it (REDUCE),
`Instance` as creating an object of it and setting its state (NEWOBJ + BUILD), the way
torch's own objects pickle. `DType`s and `Size`s pickle as their torch counterparts.
"""

from __future__ import annotations

import functools
import io
import pickle
from dataclasses import dataclass
from typing import Any

from ckptctl.core.dtypes import DType


@dataclass(frozen=True)
class Global:
    """A module-level name in the unpickling process (`torch.Size`), referenced by name only."""

    module: str
    name: str


@functools.cache
def ref(module: str, name: str) -> Global:
    """The one `Global` for (module, name): pickled once and then fetched from the memo, as pickle does."""
    return Global(module, name)


@dataclass(frozen=True)
class Call:
    """Unpickles as `func(*args)`."""

    func: Global
    args: tuple


@dataclass(frozen=True)
class Instance:
    """Unpickles as `cls.__new__(cls)` with `state` applied (`__setstate__` or `__dict__.update`)."""

    cls: Global
    state: Any


@dataclass(frozen=True)
class Persistent:
    """A persistent reference (torch.save's storage records): the unpickler resolves `pid`."""

    pid: tuple


class Size(tuple):
    """A tuple that pickles as `torch.Size` (DCP stores shapes and offsets as torch.Size)."""

    __slots__ = ()


class _Writer(pickle._Pickler):  # the Python pickler: its dispatch table can be extended
    dispatch = dict(pickle._Pickler.dispatch)

    def _global(self, g: Global) -> None:
        if self.proto >= 4:
            self.save(g.module)
            self.save(g.name)
            self.write(pickle.STACK_GLOBAL)
        else:
            self.write(pickle.GLOBAL + f"{g.module}\n{g.name}\n".encode())
        self.memoize(g)

    def _call(self, c: Call) -> None:
        self.save(c.func)
        self.save(c.args)
        self.write(pickle.REDUCE)
        self.memoize(c)

    def _instance(self, obj: Instance) -> None:
        self.save(obj.cls)
        self.write(pickle.EMPTY_TUPLE + pickle.NEWOBJ)
        self.memoize(obj)
        self.save(obj.state)
        self.write(pickle.BUILD)

    def _persistent(self, p: Persistent) -> None:
        self.save(p.pid)
        self.write(pickle.BINPERSID)

    def _dtype(self, d: DType) -> None:
        self.save(ref("torch", d.name))

    def _size(self, s: Size) -> None:
        self.save(Call(ref("torch", "Size"), (tuple(s),)))

    dispatch[Global] = _global
    dispatch[Call] = _call
    dispatch[Instance] = _instance
    dispatch[Persistent] = _persistent
    dispatch[DType] = _dtype
    dispatch[Size] = _size

    def save(self, obj: Any, save_persistent_id: bool = True) -> None:
        to_pickle = getattr(type(obj), "__torch_pickle__", None)
        if to_pickle is not None:  # a stand-in for one of torch's classes describes its own pickle
            obj = to_pickle(obj)
        super().save(obj, save_persistent_id)


def dumps(obj: Any, protocol: int = pickle.DEFAULT_PROTOCOL) -> bytes:
    """Pickle `obj`; `Global`/`Call`/`Instance`/`Persistent`/`DType`/`Size` and objects with a
    `__torch_pickle__` method (returning one of those) become references to torch's globals."""
    buf = io.BytesIO()
    _Writer(buf, protocol=protocol).dump(obj)
    return buf.getvalue()
