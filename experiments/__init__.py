"""Experiments for dpsco_jax: data loaders and runnable training jobs.

Run a job from the repository root, e.g.

    python -m experiments.quickstart --config=configs/quickstart.py
"""
