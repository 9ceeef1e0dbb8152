"""`msinfer serve`: protocol (schemas), app (routes), serving, serving_completion and
serving_chat (what the routes do), api_server (a rank's run: lead or follow, drain, stop),
lockstep (engine loop across ranks), handoff (the host-side channel between ranks), metrics
(Prometheus)."""
