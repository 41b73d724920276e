"""Independent checks of a written output: the default structural and sampled check, and `--verify`'s byte-for-byte one."""
