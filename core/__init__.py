"""What engine/, matrix_store/ and services/ all need, and nothing else: the domain errors
(`trserve.core.errors`), tenant ids and their namespaces (`trserve.core.tenants`), the identity of the model a matrix belongs to (`trserve.core.model_spec`), the bundled
prompt sets (`trserve.core.datasets`) and the progress display of long runs (`trserve.core.progress`).
No torch, grpc, redis or numpy here."""

if __name__ != "trserve.core":  # core/ sits at the repository root; trserve.core is its only import name
    raise ImportError(f"import trserve.core, not {__name__}: core/ installs under the trserve name only")
