"""The checkpoint as data, and pure planning over it: shapes, dtypes, boxes, copy plans, the analysis `inspect` shows.

No I/O: every module here is a function of metadata, built and tested without a disk."""
