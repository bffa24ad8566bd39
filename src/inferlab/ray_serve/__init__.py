"""`inferlab serve --replicas N` on Ray Serve: several engine replicas behind one OpenAI endpoint
(docs/architecture.md gives each module's job).

Ray is an optional extra (`pip install 'inferlab[ray]'`); nothing outside this package imports it.
"""
