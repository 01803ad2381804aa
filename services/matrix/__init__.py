"""The matrix service: a grpc.aio server around matrix_store.MatrixStore (server.py, servicer.py),
its CLI (cli.py), and the worker-side draft sources that use it (client.py: remote and replica).
Generated protobuf code comes from `make proto` (trserve/v1/matrix_pb2*.py)."""
