"""What engine/, matrix_store/ and services/ all need, and nothing else: the domain errors
(`core.errors`) and the identity of the model a matrix belongs to (`core.model_spec`).
No torch, grpc, redis or numpy here."""
