"""One module per command: parse nothing, plan, write through the engine, check, commit. The CLI calls these; so can scripts."""
