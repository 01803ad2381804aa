"""`trserve generate` on the command line; the client it calls through is trserve_client (clients/python)."""
