"""Micro-benchmarks of one path on the CPU: a lookup against its floors
(``lookup``), the bindings' ABI (``abi3_overhead``), hashing a prompt
(``ngram_hash``), the seed's gather (``seed_gather``) and a fresh server's
first requests (``first_requests``)."""
