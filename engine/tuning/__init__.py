"""Choosing the tree for a device and a workload: acceptance records from real decoding
(records.py), the forward cost per width (calibrate.py), the tree optimiser (optimise.py), online
re-tuning while serving (online.py), and `trserve tune` (cli.py)."""
