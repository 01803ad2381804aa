"""The matrix service: a grpc.aio server around matrix_store.MatrixStore (server.py, servicer.py),
server-side remote draft sessions (sessions.py), proto conversion shared with its clients
(convert.py) and its CLI (cli.py). The worker-side clients live in services/worker/drafting/.
Generated protobuf code comes from `make proto` (trserve/v1/matrix_pb2*.py)."""
