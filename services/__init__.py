"""The gRPC services, their CLIs and clients (trserve.services)."""

if __name__ != "trserve.services":  # services/ sits at the repository root; trserve.services is its only import name
    raise ImportError(f"import trserve.services, not {__name__}: services/ installs under the trserve name only")
