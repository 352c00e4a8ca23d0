"""keras_cct's benchmarks: each module is runnable (``python -m benchmarks.lowering``) and writes
JSON, a markdown table and a PNG plot under ``docs/benchmarks/``."""
