"""`msinfer serve`: protocol (schemas), app (routes), lockstep (engine loop across ranks),
handoff (the host-side channel between ranks), metrics (Prometheus)."""
