"""Commands around a run: throughput benchmark, run report, Hugging Face export and generation."""
