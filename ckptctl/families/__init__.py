"""Model families: declarative two-way tables of rules between Hugging Face names and a source's, one module per family."""
