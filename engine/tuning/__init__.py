"""Choosing the tree for a device and a workload: acceptance records from real decoding
(records.py), the forward cost per width (calibrate.py, cost.py), the tree optimiser (optimise.py)
and online re-tuning while serving (online.py). The command `trserve tune` is bench/tune.py; the
per-step option choosers are engine/drafting/budget/."""
