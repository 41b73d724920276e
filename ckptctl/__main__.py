"""`python -m ckptctl` (also what `torchrun -m ckptctl` runs)."""

from ckptctl.cli import main

main()
