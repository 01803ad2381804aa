"""What engine/, matrix_store/ and services/ all need, and nothing else: the domain errors
(`core.errors`), tenant ids and their namespaces (`core.tenants`), the identity of the model a matrix belongs to (`core.model_spec`), the bundled
prompt sets (`core.datasets`) and the progress display of long runs (`core.progress`).
No torch, grpc, redis or numpy here."""
