"""`python -m ckptctl` (also what `torchrun -m ckptctl` runs)."""

from ckptctl.interrupt import exit_on_interrupt

exit_on_interrupt()  # before the command line's imports: Ctrl-C during start-up is one line too

from ckptctl.cli import run  # noqa: E402

run()
