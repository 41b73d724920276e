"""`python -m ckptctl` (also what `torchrun -m ckptctl` runs); `ckptctl.cli` takes Ctrl-C over first."""

from ckptctl.cli import run

run()
