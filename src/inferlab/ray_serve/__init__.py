"""`inferlab serve --replicas N` on Ray Serve: several engine replicas behind one OpenAI endpoint.

    ingress.py    the OpenAI routes (a FastAPI app as Serve's ingress): tokenizes the prompt once,
                  streams each request to an engine replica, retries one that died before its
                  first byte on another
    replica.py    one engine replica: our whole server (`server/app.py`) on a loopback port inside
                  a Ray actor, health checks, routing and autoscaling stats, drain on shutdown
    router.py     Serve's custom request router: the router issue's scoring core
                  (`router/policies.py`, `router/prefix_index.py`) over Serve's replicas
    autoscale.py  a custom autoscaling policy on queued prompt tokens (plain Python: unit-tested)
    launch.py     flags → a local Ray cluster (or --ray-address), the deployments, serve until SIGTERM

Ray is an optional extra (`pip install 'inferlab[ray]'`); nothing outside this package imports it.
"""
