"""Pickles read without executing them (a bounded VM that builds only known classes) and written byte-exactly like torch's."""
