"""streamproc: a NATS stream processor that joins prefill/decode LLM responses."""
__version__ = "0.1.0"
