"""The engine frontend: what runs in the caller's process. `Engine` (the embedded library), the
Receiver that validates and tokenizes requests, the core client that sends them across the
process boundary to `api/core/` (or to data-parallel replicas), and text decoding of the
outputs that come back."""
