"""Datasets: GSM8K preprocessing into verl-format parquet, and the validated prompt batches the trainer reads."""
