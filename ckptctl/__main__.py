"""`python -m ckptctl` (also what `torchrun -m ckptctl` runs)."""

import sys

try:
    from ckptctl.cli import main

    main()
except KeyboardInterrupt:  # Ctrl-C before a command's own handler is in place (start-up, imports)
    sys.stderr.write("ckptctl: interrupted\n")
    raise SystemExit(130) from None
