"""Self-checks of the harness: the client and prompt benchmarks, the mock server, the peer tools run against
it, and the GPU checks. Nothing in the product imports this package."""
