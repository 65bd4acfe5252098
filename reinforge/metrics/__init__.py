"""A run's figures outside the bus: the monitor's writers (`writers`: the JSONL records of
`<run_dir>/metrics/`, the snapshot file, TensorBoard scalars, Prometheus text on /metrics)
and the offline report built from those records (`report`: plots, report.md, report.json).
"""
