"""`trserve load`: a bounded, loopback-only load generator for Generate workers (see runner.py)."""
