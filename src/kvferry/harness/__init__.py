"""Drives whole P/D systems: process supervision, the load client, the colocated reference, live
sampling, chaos runs, the demo, its report and plots. Used by `bench/` and `cli.py`; nothing in
`transfer/`, `connector/`, `engine/` or `serving/` imports it."""
