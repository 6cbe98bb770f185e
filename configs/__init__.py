"""Config files (`ml_collections`) for the jobs in `experiments/`."""
