"""Where bytes come from and go: opening input files safely, positioned reads, the Hugging Face Hub, atomic output.

The local filesystem is the one store today; formats read and write through this layer only."""
