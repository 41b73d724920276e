"""CRC-32 for the zip records ckptctl writes: the one per-byte computation of a plain copy.

Every torch.save record carries the CRC-32 of its tensor bytes. zlib computes it at about
5 GB/s, a third of a 2 GB reshard's CPU time on two cores; ISA-L (the `isal` package,
carry-less multiply instructions) at about 45 GB/s, with the same values. It is used where
its wheels exist (x86-64, arm64), zlib elsewhere.
"""

from __future__ import annotations

try:
    from isal.isal_zlib import crc32
except ImportError:  # no isal wheel for this machine
    from zlib import crc32

__all__ = ["crc32"]
