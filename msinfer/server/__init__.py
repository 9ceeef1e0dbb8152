"""`msinfer serve`: protocol (schemas), app (routes), serving, serving_completion and
serving_chat (what the routes do), api_server (a rank's run: lead or follow, drain, stop),
lockstep (a tensor group's engine loop), replicas (data replicas behind rank 0's router),
handoff (the host-side links between ranks), metrics (Prometheus), reasoning (thinking models'
answers split)."""
