"""The split deployment as local processes (`trserve cluster up|down|status`), shared by the tests."""
