"""The tools above the services: `trserve bench` (cli.py, runner.py and its modes), the concurrency
bench, `trserve tune` (tune.py), the peers (llama_server.py) and the files users bring (files.py)."""

if __name__ != "trserve.bench":  # bench/ sits at the repository root; trserve.bench is its only import name
    raise ImportError(f"import trserve.bench, not {__name__}: bench/ installs under the trserve name only")
