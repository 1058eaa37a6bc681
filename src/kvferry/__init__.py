"""kvferry: fault-tolerant KV-cache transfer for P/D disaggregated serving."""
__version__ = "0.1.0"
